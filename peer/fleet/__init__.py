"""A fleet of ``lpdl-peer start`` daemons on this machine: launch them, watch them, report on them.

    launch.py   daemon argv, subprocess start, stop (SIGTERM, then SIGKILL after a timeout)
    observe.py  what the fleet learned from a daemon's status snapshots (pure bookkeeping)
    watch.py    polling the control sockets, the live table
    history.py  the fleet's curves while it runs (accuracy, consensus distance, bytes), history.csv, fleet.png
    report.py   final checkpoint evaluation, summary.json, the summary text
    mass.py     push-sum totals over checkpoints (the conservation invariant; imports torch)
    run.py      one whole fleet run, as ``lpdl-peer fleet`` and bench scripts use it

torch-free at import: :func:`peer.fleet.report.evaluate_checkpoints` loads the training stack and the history's
samples load torch, when they run; mass.py imports torch.
"""
