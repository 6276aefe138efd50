"""Control plane: evaluation of weight versions (curriculum, gate, run store to come)."""
