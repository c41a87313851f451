"""How much memory a configuration needs, and where "auto" places things.

`estimator` (`zkernel.estimate`: bytes per rank by category and device, and
the `zkernel estimate` table, from the components' own answers through
`zkernel.kernel.sizing.Estimator`), `planning` (resolving "auto" through the
selected planner, without training), `model_shape` (a model by its
transformer numbers, and activation estimates; defined in
`zkernel.spec.model_shape`).
"""
