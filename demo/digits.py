"""Large batch vs micro-batches + GradientAccumulation on scikit-learn's digits (no download).

Trains the same MLP three ways with `fit_one_cycle`: batches of 256; micro-batches of 32 accumulated to 256 with this
library; the same micro-batches with fastai's own `GradientAccumulation`. \
Prints each run's final metrics and the largest
parameter difference from the large-batch run, and saves the loss curves to `<out>/loss_curves.png`.
Float64 throughout, so that "the same training" can be checked to rounding error."""
import argparse
from pathlib import Path
import matplotlib; matplotlib.use('Agg')
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import fit_digits, plot_runs, runs_table

def main(out:Path, epochs:int, accum_bs:int, micro_bs:int):
    out.mkdir(parents=True, exist_ok=True)
    k = accum_bs//micro_bs
    timed = {
        f'large batch ({accum_bs})': fit_digits(accum_bs, epochs=epochs),
        f'fastxtend_accum ({k}x{micro_bs})': fit_digits(micro_bs, GradientAccumulation(accum_bs), epochs=epochs),
        f"fastai's GradientAccumulation ({k}x{micro_bs})": fit_digits(
            micro_bs, FastaiGradientAccumulation(accum_bs), epochs=epochs
        ),
    }
    runs = {name: learn for name,(learn,_) in timed.items()}
    print(f"digits: 1,500 training / 297 validation samples, {epochs} epochs of fit_one_cycle, Adam, float64\n")
    for row,(_,secs) in zip(runs_table(runs).split('\n'), [(None,'time (s)')] + list(timed.values())):
        print(f"{row}{secs:>10}" if isinstance(secs, str) else f"{row}{secs:>10.1f}")
    fig = plot_runs(runs, epochs, 'digits, fit_one_cycle: the accumulated run is the large-batch run')
    fig.savefig(out/'loss_curves.png', dpi=110)
    print(f"\nsaved {out/'loss_curves.png'}")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', type=Path, default=Path('demo/out'))
    p.add_argument('--epochs', type=int, default=20)
    p.add_argument('--accum-bs', type=int, default=256)
    p.add_argument('--micro-bs', type=int, default=32)
    a = p.parse_args()
    main(a.out, a.epochs, a.accum_bs, a.micro_bs)
