"""`lpdl-peer energy`: operation counts and Horowitz 45 nm energy of a model, fp32 vs 8-bit (docs/method.md#compute-and-energy).

torch is imported inside the command only, so ``lpdl-peer energy --help`` stays light.
"""

from __future__ import annotations

import json

import click

from peer.energy_prices import PRICINGS


@click.command("energy")
@click.option("--model", "model_name", default="resnet20", show_default=True, help="Model name in the model registry.")
@click.option("--batch", default=32, show_default=True, type=click.IntRange(min=1), help="Samples per training step.")
@click.option("--image-size", default=32, show_default=True, type=click.IntRange(min=1), help="Input height = width.")
@click.option("--in-channels", default=3, show_default=True, type=click.IntRange(min=1), help="Input channels.")
@click.option("--num-classes", default=10, show_default=True, type=click.IntRange(min=2), help="Output classes.")
@click.option("--norm", default="range-evonorm", show_default=True, help="Normalisation-activation layer kind.")
@click.option("--pricing", type=click.Choice(PRICINGS), default=PRICINGS[0], show_default=True,
              help="How the table prices the 8-bit model: quantization arithmetic and pooling in fp32 (quant-fp32), "
                   "or every add and multiply at the int8 price as the paper's section 5 does (paper). The ratio "
                   "lines and --json give both.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON instead of a table.")
def energy(model_name: str, batch: int, image_size: int, in_channels: int, num_classes: int, norm: str,
           pricing: str, as_json: bool) -> None:
    """Count adds and multiplies per layer for a training step and an inference pass, and price them in fp32 and
    8-bit (fp32 add 0.9 pJ, mult 3.7 pJ; int8 add 0.03 pJ, mult 0.2 pJ)."""
    from peer.energy import energy_report, format_report
    from peer.models import build_model

    try:
        model = build_model(model_name, num_classes=num_classes, in_channels=in_channels, norm=norm)
    except (KeyError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--model/--norm") from exc
    report = energy_report(model, (in_channels, image_size, image_size), batch=batch)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report, pricing))
