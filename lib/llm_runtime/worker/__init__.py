"""The worker layer: what owns a device and runs the model on it.

`plan.py` chooses, once, how the model runs (backend, packing, compiling, graphs, native step) with the reason for
each; `Worker` (worker.py) prepares its model from the plan and holds its KV pool; `ModelRunner` (model_runner.py)
turns a scheduled batch into inputs (input_batch.py), runs the forward pass the plan chose (eagerly, compiled:
compiled_forward.py, from CUDA graphs: cuda_graphs.py, or as one native call: native_step.py) and samples.
`kv_budget.py` sizes the pool; `step_channel.py` carries a step's inputs to the other ranks.
"""
