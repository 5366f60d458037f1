"""Continuous batching on top of the prefix cache: the Scheduler's loop (scheduler.py; its admission and
prefill stage: prefill_stage.py), what it holds per request (state.py), its requests and results
(requests.py), its settings (settings.py), its KV budget (kv_budget.py), the order it admits waiting
requests in (admission.py), which prompt chunks share one forward (side_by_side.py), answers re-prefilled
for the next turn (answers.py), programs compiled ahead (compile_ahead.py) and the library's batched call
generate_many (many.py).
Imports: cache (prefix_cache, records, store) and jaxsmol."""
