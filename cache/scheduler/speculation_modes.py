"""Speculation's modes and verify-step shapes: what the command line's options offer, kept apart from
speculation.py so that parsing them imports no jax (`jaxsmol --help`)."""

# ngram: drafts from the request's own tokens; cache: from those and from what the prefix cache stored after
# its prompt; draft: from a draft model (draft_model.py); auto: draft where a draft model is given, else cache
# where the CPU kernels run (a verify step's exactness needs them), none elsewhere
SPECULATE_MODES = ("auto", "none", "ngram", "cache", "draft")
# a verify step's positions per row (its program shapes), padded up to one of these. Not 2 as well: a
# row's 1 draft verified in 4 positions costs about what 2 do (a step of few rows streams the weights
# whatever its rows), and 5 more programs were 4.5 s of a daemon's 30 s warm-up
VERIFY_ROWS = (4, 8)
