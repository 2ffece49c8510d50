"""Vocabulary of the technical-support generator, written for this project (no external data).

Invariants the tests check: filler holds no digits and no fact value (codes, versions,
serials, ports and durations appear only in the message that states them), so a probe's
answer lives in exactly one message. Config keys, hostnames and backup job names are
lowercase on purpose.
"""

from __future__ import annotations

PRODUCTS = ("Nimbus mesh router", "Kestrel home NAS", "Orbit print server", "Halcyon smart hub", "Tern thermostat")
AGENTS = ("Dana", "Priyanka", "Mateo", "Ines", "Gareth", "Yusuf")
CUSTOMERS = ("Alex", "Jordan", "Morgan", "Robin", "Casey", "Sasha")
MONTHS = ("March", "April", "May", "June", "July", "August", "September", "October")
CONFIG_KEYS = (
    "sync.retry_backoff_ms",
    "net.dhcp_lease_hours",
    "storage.scrub_interval",
    "wifi.band_steering",
    "log.verbosity_level",
    "power.idle_timeout",
    "cloud.relay_mode",
)
SETTINGS = ("off", "strict", "low", "manual", "disabled")
HOSTNAME_PARTS = (("nas", "hub", "office", "attic", "den"), ("kitchen", "study", "garage", "loft", "hall"))
BACKUP_JOBS = ("photos-offsite", "docs-mirror", "media-weekly", "family-archive", "tax-folder-sync")
PROVIDERS = ("Lumen Fibre", "Northwind Broadband", "Coastline Telecom", "Brightpath Net", "Vale Internet")

SYMPTOMS = (
    "It keeps dropping the connection, usually right when I'm in the middle of a video call.",
    "The status light has been blinking amber since this morning and nothing seems to fix it.",
    "The app says the device is offline, but I can see it sitting right there with its lights on.",
    "It worked perfectly for months and then suddenly started acting up after the last update.",
    "Sometimes it comes back on its own after a while, which makes it really hard to pin down.",
    "My partner says it restarted itself twice overnight, we could hear the fan spinning up.",
    "The setup page loads really slowly, and half the time it just times out.",
    "Everything else on the network is fine, it's only this one device that misbehaves.",
    "It gets noticeably warm when this happens, not hot exactly, but warmer than usual.",
    "I already tried turning it off and on again, before you ask, a couple of times actually.",
)
CONTEXT = (
    "I work from home, so this is becoming pretty urgent for me.",
    "We had a short power cut last week, not sure if that's related.",
    "I'm not super technical, so please bear with me if I ask silly questions.",
    "It sits on a shelf in the hallway, next to the modem.",
    "We've got quite a few devices connected, phones, laptops, a smart speaker and the TV.",
    "I set it up myself following the quick start leaflet, it seemed to go fine at the time.",
    "I've been a customer for a few years and never had problems before this.",
    "Honestly I'm a bit fed up, I've spent most of the evening on this.",
)
USER_ACKS = (
    "Okay, doing that now, give me a moment.",
    "Right, one sec, I'm at the device now.",
    "Done. It's rebooting, the lights are cycling.",
    "Okay, I think I found the menu you mean.",
    "That didn't change anything, unfortunately.",
    "It looks a little better, but I'm not sure yet.",
    "Hang on, my laptop is being slow as well.",
    "Sure, I can try that.",
)
EXPLANATIONS = (
    "That pattern usually means the device lost its link to our cloud service and is retrying in the background.",
    "Updates sometimes reset a few advanced settings to their defaults, which can cause exactly this.",
    "Heat alone is rarely the cause, but good airflow around the unit definitely helps.",
    "Intermittent problems are the trickiest ones, so thank you for your patience while we narrow it down.",
    "The logs on the device keep a record of the last few restarts, which will tell us a lot.",
    "If the modem hands out addresses too aggressively, the device can lose track of its own address.",
    "A factory reset is our last resort, so let's try the gentler options first.",
    "Some routers have a power saving feature that puts quiet devices to sleep a little too eagerly.",
    "I'm checking your device history on our side as well, so we aren't working blind.",
    "It's worth ruling out the cable too, a slightly loose connector can cause drop-outs like these.",
)
AGENT_QUESTIONS = (
    "Could you tell me what colour the status light is right now?",
    "Is the device connected by cable or over wifi?",
    "Did anything change on your network recently, like a new modem?",
    "Do you see any message in the app when it goes offline?",
    "Roughly how often does this happen, every hour or a few times a day?",
    "Are you able to open the device's settings page from your laptop?",
)
EMPATHY = (
    "I'm sorry, I know how frustrating this is.",
    "Thanks for bearing with me.",
    "Understood, let's sort it out.",
    "Good to know, that helps.",
    "Thanks, that's useful.",
    "No problem at all.",
)
STEP_LISTS = (
    (
        "Open the app and go to the device page",
        "Tap the gear icon in the top corner",
        "Choose advanced settings",
        "Scroll down to the diagnostics section",
    ),
    (
        "Unplug the device from power",
        "Wait about half a minute",
        "Plug it back in and wait for a steady light",
        "Check the app again",
    ),
    (
        "Open the settings page in your browser",
        "Sign in with the admin account",
        "Go to the network tab",
        "Look for the list of connected clients",
    ),
)
CLOSERS = (
    "Let me know how that goes.",
    "Tell me what you see after that.",
    "I'll wait here.",
    "Take your time, I'm not going anywhere.",
)
RECALL_REPLIES = (
    "Let me scroll back through our conversation to find that for you.",
    "Good question, give me a moment to check the ticket notes.",
    "One moment, I'm pulling up the earlier part of this chat.",
    "Let me look that up in the case history so I give you the right one.",
)
REOPEN = (
    "Chat reopened — the next morning",
    "Chat reopened — two days later",
    "Chat reopened — later that evening",
    "Chat reopened — the following week",
)
