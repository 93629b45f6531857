"""Who may speak to a peer (docs/design.md#trust): the fleet CA and certificates (ca.py), the identity a certificate
binds (identity.py), and the gRPC credentials built from them (credentials.py). ``ca`` and ``identity`` import neither
torch nor grpc, so ``lpdl-peer ca`` starts fast."""
