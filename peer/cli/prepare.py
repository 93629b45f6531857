"""``lpdl-peer prepare``: compile the int8 pass graphs of a config into this host's store, once, before its daemons
start (:mod:`peer.daemon.prepare` does the work and says why)."""

from __future__ import annotations

from typing import Any

import click

from peer.cli.options import RUN_FLAGS, SpecFlag, pop_daemon_config, run_spec_options, spec_options

PREPARE_FLAGS: list[SpecFlag] = [
    SpecFlag("--device", "node", "device", str, "torch device the daemons train on (only cpu stores graphs)."),
    SpecFlag("--threads", "node", "threads", int, "torch intra-op threads while compiling (0 = torch's default)."),
]


@click.command("prepare")
@run_spec_options()
@spec_options(PREPARE_FLAGS)
def prepare(**kwargs: Any) -> None:
    """Compile the 8-bit pass graphs a daemon of this config runs (the same --config and flags as start) into the
    host's store, so that the first daemon, or the first local fleet, runs them compiled instead of eagerly.

    Run it as the user the daemons run as, with the same LPDL_CACHE_DIR (the store is per user cache, CPU, torch
    version and pass code: run it again after an upgrade). A few minutes once (the MNIST CNN: 39 graphs in about 4
    minutes on 2 cores); seconds when everything is stored already. Exit code 1 if a pass could not be compiled
    (daemons run it eagerly), or where none can be (no C++ compiler).
    """
    config = pop_daemon_config(kwargs, RUN_FLAGS + PREPARE_FLAGS)
    import torch

    from peer.daemon.prepare import PrepareError, prepare_host

    if config.node.threads:
        torch.set_num_threads(config.node.threads)
    run = config.run
    try:
        done = prepare_host(run, torch.device(config.node.device))
    except (ValueError, PrepareError) as exc:  # a dataset, a model source, the store
        raise click.ClickException(str(exc)) from None
    what = f"{run.model.name}, batch {run.data.batch_size}, {run.model.precision}"
    if done.skipped:
        click.echo(f"nothing to prepare for {what}: {done.skipped}")
        return
    if done.store is not None:
        click.echo(f"int8 pass graphs for {what}: {done.compiled} compiled, {done.loaded} found stored by a "
                   f"daemon's first steps, in {done.seconds:.1f} s; store {done.store}")
    if done.failed or done.left:
        for name, reason in sorted(done.failed.items()):
            click.echo(f"  {name}: not compiled ({reason}); a daemon runs that eagerly", err=True)
        if done.left:
            click.echo(f"  {done.left} pass signatures still run eagerly in a daemon (see the log above)", err=True)
        raise SystemExit(1)
