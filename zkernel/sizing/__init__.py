"""How much memory a configuration needs, and where "auto" places things.

`estimator` (bytes per rank by category and device, the `zkernel estimate`
table), `planning` (resolving "auto" through the selected planner),
`model_shape` (activation estimates for transformer shapes).
"""
