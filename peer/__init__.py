"""lpdl-peer: decentralized low-precision learning daemon for edge devices.

Package map (one concern per room; the architecture is docs/design.md#architecture):
    cli/        one module per command: parse, call, print (no torch for --help, status, ca)
    config.py   the typed specs every driver shares, validated per field; TOML in and out
    runtime/    what every driver shares: assembly, the peer, the round, recovery, the checkpoint schema
    gossip/     push-sum state, the three algorithms, the exactly-once ledger, the engine, topologies, optimizer
    compress/   layer-wise top-k, k-bit values, index coding, the payload codec
    net/        gRPC server and client streams, the daemon's Transport, discovery, limits, byte accounting
    security/   fleet CA, certificates, TLS credentials
    daemon/     the daemon's lifecycle, gate, status, control socket, metrics, allocator; its config (the whole
                config, loaded once) and kinds (phases, exit codes, allocators)
    sim/        the simulator: in-memory Transport and loop
    fleet/      `lpdl-peer fleet`: launch, watch, history, report, mass conservation over checkpoints
    lowp/       8-bit training: quantizers, fused passes, int8 kernels and probe, layers, EvoNorms, the converter
    models/     model zoo, registry, fingerprint; the user's own models (source, plugin)
    data/       dataset readers, augmentation, skew partitioner; the user's own datasets (plugin)
    export/     the trained model out: safetensors, TorchScript, ONNX and a card
    api.py      the Python API (simulate, train)    plugins.py  importing a user's MODULE:CALLABLE / file.py:CALLABLE
    energy.py, energy_prices.py   operation counts and energy (docs/method.md#compute-and-energy)
    train.py    centralised baseline          plots.py   learning-curve PNGs (matplotlib optional)
    logs.py     logging set-up                heap.py    freed heap back to the OS
    aio.py      stopping asyncio tasks for sure (cancel again until done)
    finite.py   a whole model's finiteness by two reductions (each round's check, checkpoints)
    errors.py   PeerError: the one root of the project's errors, each with a machine-readable reason
    __main__.py ``python -m peer`` is ``lpdl-peer``
Floors (lowest first; an import never goes up one - tests/test_import_graph.py): compress, security and the root
helpers; gossip, lowp, models, data; config; runtime; net; daemon, sim, train; export, api; fleet; cli.
"""

__version__ = "0.1.0"
