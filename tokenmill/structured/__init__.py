"""Structured output: constrain a request's tokens to a grammar (a JSON schema, any JSON object,
a regex, a choice of strings, an EBNF or Lark grammar).

- `grammar.py`   `GrammarCompiler`: StructuredOutputParams -> a checked grammar, cached by
                 (kind, text); the engine compiles when it admits a request, so a bad schema
                 is a SamplingParamsError naming the field before anything is scheduled.
- `matcher.py`   `GrammarMatcher`: one sequence's place in its grammar (the runner holds one per
                 constrained request): the allowed-token bitmask for the next token, accept,
                 check drafts, roll back.
                 `MaskFiller`: many matchers' rows in one call on llguidance's threads.
- `bitmask.py`   the bitmask layout (int32 words, bit j of word w allows token 32 w + j) and
                 applying it to a batch of logits rows with torch ops.

The backend is llguidance, chosen over xgrammar by measured mask cost
(docs/serving.md#structured-output); it is imported the first time a constrained request
arrives, so engines that never see one do not load it.
"""
