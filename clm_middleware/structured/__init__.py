"""Structured output: replies that are valid JSON, or valid against a JSON schema, by construction.

``ResponseFormat`` (format.py) says what is wanted and has no heavy imports.
``grammar.GrammarCompiler`` (xgrammar, imported only when a reply is constrained;
``grammar.compiler_for(engine)`` keeps one per engine) compiles it for a tokenizer, and hands out a
``GrammarConstraint`` per reply: a logits processor that masks every token the grammar
does not allow next. Like the penalties, it is part of the engine layer (it touches
logits); the lifecycle only passes it to ``Engine.generate``.
"""

from clm_middleware.structured.format import ResponseFormat

__all__ = ["ResponseFormat"]
