"""Operations a user calls in a model: `tiled_loss` (cross-entropy in tiles over the vocabulary)."""
