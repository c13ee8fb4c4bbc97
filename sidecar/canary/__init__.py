"""``kvguard canary``: a black-box cross-tenant canary prober for a serving endpoint.

It plants unique markers in the prompts of a synthetic victim tenant ("A"), drives a
second synthetic tenant ("B") down the paths where KV-cache bookkeeping has failed
before (prompts around the KV pool and context limits, shared prefixes, cancelled
streams, concurrency) and looks for A's markers in B's output.

Modules: :mod:`.budget` (the request budget every HTTP call goes through),
:mod:`.limits` (what the server says about its pool and context),
:mod:`.markers` (marker texts and the overlap search), :mod:`.clients` (SGLang
``/generate``, a prefill/decode pair driven like SGLang's router, OpenAI
``/v1/completions``), :mod:`.plan` (which probes, sized to the budget),
:mod:`.runner` (runs the plan), :mod:`.report` (text and JSON, exit codes).
See docs/canary.md.
"""
