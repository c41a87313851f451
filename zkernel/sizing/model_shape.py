"""The models `zkernel.estimate` measures: defined in `zkernel.spec.model_shape` (a planner reads
them through the contract); re-exported here, where the estimator's users import them from."""

from zkernel.spec.model_shape import DTYPE_BYTES, TransformerShape, as_module, as_shape, estimate_activations

__all__ = ["DTYPE_BYTES", "TransformerShape", "as_module", "as_shape", "estimate_activations"]
