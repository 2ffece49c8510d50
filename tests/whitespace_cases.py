"""Messages whose whitespace a byte-level tokenizer merges across what the segmenter
splits (runs of spaces, blank lines, CRLF, indented lists): the context must hold them
with the bare chat template's ids."""

WHITESPACE_MESSAGES = [
    "1. Pack\n   - passport\n   - charger\n2. Travel\n   - taxi",
    "First line.\r\nSecond line here.\r\n\r\nThird paragraph.",
    "Title.\n\n\n\nBody of the note.",
    "Hello   there.    How   are you doing today?",
    "Question here?\n\n\n",
    # leading whitespace joins the header's newline in the template's text (ĊĠĠĠ, Ċĉ)
    "  I need a taxi to the station.",
    "\t\tMy booking reference is QX-4471.",
    "    def add(a, b):\n        return a + b\nWhat does this do?",
    "\n\n\n  A note after blank lines.",
    # sentences with nothing between them (Chinese, Japanese): no space is added
    "我今天早上喝了一杯很好喝的咖啡。然后我去公园散步了很长时间。",
    "How are you? 我叫李雷，很高兴认识你。My name is Li Lei and I live here.",
]
