"""The per-reply grammar constraint, as an engine logits processor.

``GrammarConstraint(generated_ids, logits) -> logits`` with ``-inf`` on every token the
grammar does not allow next. It works with any choice rule (greedy, temperature,
top-p, and whatever else the sampler adds), because it only removes candidates.

Invariants:
- Stateful, one per reply: the matcher has seen the prefix and exactly the generated
  ids it was last called with. The engine calls it once per step with the ids generated
  so far; it feeds the ones it has not seen, then masks. A generated id the grammar
  rejects is a bug upstream (a processor after this one chose it): ``RuntimeError``.
- The stop token is allowed only once the document is complete, and then nothing else
  is: an answer ends exactly where its JSON ends. When ``max_new_tokens`` runs out
  first, the engine's finish reason is ``length`` and the text is an unfinished prefix.
- It never leaves every logit ``-inf``: if the logits it is given (after the engine's
  own processors) are ``-inf`` on every allowed token, the allowed tokens get logit 0,
  so the grammar wins and the choice is still one it allows. An empty allowed set means
  the schema admits no document here: ``ConfigError``.
- It never writes into the tensor it is given (the engine reads log-probs from it).
- ``close_string()`` (the turn calls it when the reply repeats itself inside a string
  value) narrows the allowed tokens to those that end the string, for as long as one
  is allowed and until one is generated; the document stays valid, and a small model
  looping inside a value gets to write the rest of the document instead of spending
  every remaining token there. ``close_number()`` does the same for a number literal
  (a digit loop: ``"age": 3333333...``): the tokens that do not go on with it;
  ``close_array(closer)`` for an array whose items repeat (``array_watch.py``): the
  tokens that end the item and the array.
"""

from __future__ import annotations

import torch
import xgrammar

from clm_middleware.errors import ConfigError

_BITS = 32  # xgrammar packs the mask into int32 words


class GrammarConstraint:
    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        vocab_size: int,
        banned_ids: torch.Tensor,
        prefix_ids: list[int],
        quote_ids: torch.Tensor | None = None,
        number_end_ids: torch.Tensor | None = None,
        array_end_ids: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._quote = _mask(vocab_size, quote_ids)  # tokens holding an unescaped '"'
        self._number_end = _mask(vocab_size, number_end_ids)  # tokens that do not go on with a number
        # per closer of the item being written: tokens that end it and its array
        self._array_end = {closer: _mask(vocab_size, ids) for closer, ids in (array_end_ids or {}).items()}
        self._closing: torch.Tensor | None = None  # the tokens that end the value being closed
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._banned = banned_ids
        self._shifts = torch.arange(_BITS, dtype=torch.int32)
        self._seen = 0  # generated ids fed to the matcher
        for token in prefix_ids:
            if not self._matcher.accept_token(int(token)):
                raise ConfigError("reply_prefix", "does not start a document the response format allows")

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole document (the stop token may follow)."""
        return self._matcher.is_completed() or self._matcher.is_terminated()

    def allowed(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean ``[vocab]``: the tokens the grammar allows next (state unchanged)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask[0].to(device)
        bits = (words.unsqueeze(-1) >> self._shifts.to(words.device)) & 1  # bit j of word i: token 32 i + j
        mask = bits.flatten()[: self.vocab_size].bool()
        if self._banned.numel():
            mask[self._banned.to(mask.device)] = False
        return mask

    def close_string(self) -> None:
        """Steer the next tokens to end the string being written (see the module docstring)."""
        self._closing = self._quote

    def close_number(self) -> None:
        """Steer the next tokens to end the number being written (see the module docstring)."""
        self._closing = self._number_end

    def close_array(self, closer: str) -> None:
        """Steer the next tokens to end the item being written (``closer``: what it still
        needs, ``""`` when whole) and its array (see ``array_watch.py``)."""
        if closer in self._array_end:
            self._closing = self._array_end[closer]

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in generated[self._seen :]:
            if not self._matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} breaks the grammar: a processor after the constraint chose it")
            if self._closing is not None and 0 <= token < self.vocab_size and self._closing[token]:
                self._closing = None  # the value is closed
        self._seen = len(generated)
        shaped = self._masked(logits)
        if self._closing is not None:
            ending = self._padded(self._closing.to(shaped.device), shaped.shape[-1])
            narrowed = shaped.masked_fill(~ending, float("-inf"))
            if bool((narrowed > float("-inf")).any()):
                return narrowed
            closing = self._padded(self.allowed(shaped.device), shaped.shape[-1]) & ending
            if bool(closing.any()):  # upstream left no closing token finite: the close still wins
                return torch.zeros_like(shaped).masked_fill(~closing, float("-inf"))
        return shaped

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.device.type == "cpu" and logits.shape[-1] == self.vocab_size:
            # xgrammar's C++ kernel; unpacking the bits in torch is several times slower
            self._matcher.fill_next_token_bitmask(self._bitmask)
            shaped = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
            xgrammar.apply_token_bitmask_inplace(shaped, self._bitmask)
            if self._banned.numel():
                shaped.index_fill_(0, self._banned, float("-inf"))
        else:
            shaped = logits.masked_fill(~self._padded(self.allowed(logits.device), logits.shape[-1]), float("-inf"))
        if bool((shaped > float("-inf")).any()):
            return shaped
        allowed = self._padded(self.allowed(logits.device), logits.shape[-1])  # rare: nothing left
        if not bool(allowed.any()):
            raise ConfigError("response_format", "the schema admits no document here (it is unsatisfiable)")
        return torch.zeros_like(shaped).masked_fill(~allowed, float("-inf"))  # the grammar wins

    @staticmethod
    def _padded(allowed: torch.Tensor, size: int) -> torch.Tensor:
        """``allowed`` widened with ``False`` to the logits' size (rows past the model's vocab)."""
        if allowed.shape[0] == size:
            return allowed
        return torch.nn.functional.pad(allowed, (0, size - allowed.shape[0]), value=False)


def _mask(size: int, ids: torch.Tensor | None) -> torch.Tensor:
    """Boolean ``[size]``, true at ``ids``."""
    mask = torch.zeros(size, dtype=torch.bool)
    if ids is not None and ids.numel():
        mask[ids] = True
    return mask
