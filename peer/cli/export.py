"""``lpdl-peer export``: the trained model of a state directory, of a fleet run (the average of its peers'
checkpoints) or of a remote peer, as safetensors, TorchScript and ONNX with a JSON card (:mod:`peer.export` does the
work; torch is imported only when the command runs)."""

from __future__ import annotations

from pathlib import Path

import click

from peer.daemon.paths import TLS_DIR_NAME

#: Every format, as the --formats default (peer.export.formats.FORMATS; repeated here to keep --help torch-free).
ALL_FORMATS = "safetensors,torchscript,onnx"
#: --numerics choices (peer.export.numerics.NUMERICS, repeated for the same reason).
NUMERICS = ("trained", "fp32")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


@click.command("export")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the model files and card.json (created; an earlier export there is replaced).")
@click.option("--formats", default=ALL_FORMATS, help="Comma-separated: safetensors, torchscript, onnx.")
@click.option("--peer", default=None, help="host:port of a remote peer whose live model to export (GetModel); "
              "SOURCE then only gives the architecture (a checkpoint of the same model).")
@click.option("--tls-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="With --peer: TLS directory holding an operator certificate (`lpdl-peer ca issue --operator`) "
                   "[SOURCE/tls if it exists, else none: only a peer started with --insecure answers].")
@click.option("--normalize-in-graph", is_flag=True, help="Bake the input normalisation (card: mean, std) into the "
              "TorchScript and ONNX graphs, which then take inputs on the card's input scale (0..1 for pixels).")
@click.option("--numerics", type=click.Choice(NUMERICS), default="trained", show_default=True,
              help="What the TorchScript and ONNX graphs compute: trained = the numerics the model was trained and "
                   "is evaluated in (8-bit fake-quantized weights and activations for sim8/int8, fp32 for fp32); "
                   "fp32 = the fp32 master weights without quantization. The safetensors file is the fp32 master "
                   "weights either way.")
def export(source: Path, out_dir: Path, formats: str, peer: str | None, tls_dir: Path | None,
           normalize_in_graph: bool, numerics: str) -> None:
    """Write the de-biased model z = x / w of SOURCE - a state directory, or a fleet run directory (the average of
    its peers' checkpoints) - or of --peer, as safetensors (the model's own state dict), TorchScript and ONNX, with
    card.json (source, classes, input shape and normalisation, fingerprint, round, test accuracy, precision and the
    graphs' numerics)."""
    from peer.export import ExportError, export_model

    default_tls = source / TLS_DIR_NAME
    tls = tls_dir or (default_tls if peer and default_tls.is_dir() else None)
    chosen = tuple(f.strip() for f in formats.split(",") if f.strip())
    try:
        result = export_model(source, out_dir, formats=chosen, peer=peer, tls_dir=tls,
                              normalize_in_graph=normalize_in_graph, numerics=numerics)
    except ExportError as exc:
        raise click.ClickException(str(exc)) from None
    card = result.card
    acc = f"test acc {card['test_acc'] * 100:.2f}%" if card["test_acc"] is not None else "test acc unknown"
    origin = card["origin"]
    where = {"checkpoint": origin.get("checkpoint"), "remote": f"peer {origin.get('peer')}",
             "average": f"the average of {len(origin.get('peers', {}))} checkpoints in {origin.get('run_dir')}"}
    click.echo(f"exported {card['source']['ref']} ({card['source']['kind']}, fingerprint {card['fingerprint']}, "
               f"round {card['round']}, {acc}, trained in {card['precision']['trained_in']}) from "
               f"{where[origin['kind']]} in {card['export_s']:.1f} s")
    for entry in card["files"].values():
        click.echo(f"  {result.out_dir / entry['file']}  {_size(entry['bytes'])}")
    click.echo(f"  {result.card_path}")
    if set(card["files"]) - {"safetensors"}:
        click.echo(f"graphs compute {card['precision']['graph_numerics']}")
    state_dict = card["state_dict"]
    if "safetensors" in card["files"]:
        click.echo(f"state dict loads into {state_dict['loads_into']}" if state_dict["loads_into_source"]
                   else f"note: the state dict {state_dict['reason']}")
