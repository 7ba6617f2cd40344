"""Speculative decoding: cheap guesses of a decoding request's next tokens (drafts), checked by the target
model in one step.

At the end of a step, a proposer guesses up to k tokens that follow each decoding request's tokens
(`ngram.py`: copies what followed the latest earlier occurrence of the request's last tokens;
`draft_model.py`: a smaller causal LM of the same vocabulary, run greedily). The next step computes the
request's last token and its drafts together and gets logits for all k + 1 positions; `verify.py` keeps
the longest run of drafts that equal the target's own picks, plus the target's next pick. The engine
(`workers/engine/core.py`) and scheduler (`workers/engine/scheduler.py`) do the rest: drafts count against the token
budget and get KV blocks, and only accepted tokens advance `num_computed_tokens`.

`config.py` imports no torch: the command line reads the settings through it.
"""
