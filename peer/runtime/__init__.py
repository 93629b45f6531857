"""What every driver shares: build a peer from a spec, the one round over a Transport, the one state schema."""
