"""Large batch vs micro-batches + GradientAccumulation on scikit-learn's digits (no download).

Trains the same MLP three ways with `fit_one_cycle`: batches of 256; micro-batches of 32 accumulated to 256 with this
library; the same micro-batches with fastai's own `GradientAccumulation`. Prints each run's final metrics and the largest
parameter difference from the large-batch run, and saves the loss curves to `<out>/loss_curves.png`.
Float64 throughout, so that "the same training" can be checked to rounding error."""
import argparse, time, warnings
from pathlib import Path
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt
from fastai.basics import *
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_learner, max_param_diff

def train(bs, cb=None, epochs=20, lr=1e-2):
    learn = digits_learner(bs, opt_func=Adam, lr=lr, metrics=accuracy, shuffle=True, cbs=cb)
    start = time.perf_counter()
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit_one_cycle(epochs, lr)
    return learn, time.perf_counter()-start

def main(out:Path, epochs:int, accum_bs:int, micro_bs:int):
    out.mkdir(parents=True, exist_ok=True)
    runs = {f'large batch ({accum_bs})': train(accum_bs, epochs=epochs),
            f'fastxtend_accum ({accum_bs//micro_bs}x{micro_bs})': train(micro_bs, GradientAccumulation(accum_bs), epochs=epochs),
            f"fastai's GradientAccumulation ({accum_bs//micro_bs}x{micro_bs})": train(micro_bs, FastaiGradientAccumulation(accum_bs), epochs=epochs)}
    large = next(iter(runs.values()))[0]
    print(f"digits: 1,500 training / 297 validation samples, {epochs} epochs of fit_one_cycle, Adam, float64\n")
    print(f"{'run':<44}{'steps':>6}{'train_loss':>12}{'valid_loss':>12}{'accuracy':>10}{'max |param diff|':>18}{'time (s)':>10}")
    for name,(learn,secs) in runs.items():
        trn,val,acc = learn.recorder.values[-1]
        print(f"{name:<44}{len(learn.recorder.losses):>6}{trn:>12.6f}{val:>12.6f}{acc:>10.4f}{max_param_diff(large, learn):>18.3e}{secs:>10.1f}")
    fig,(ax,av) = plt.subplots(1, 2, figsize=(12,4.5))
    styles = [dict(lw=4, alpha=0.4), dict(lw=1.5, ls='--'), dict(lw=1, color='tab:red')]
    for (name,(learn,_)),style in zip(runs.items(), styles):
        losses = [float(l) for l in learn.recorder.losses]
        per_epoch = len(losses)/epochs
        ax.plot([(i+1)/per_epoch for i in range(len(losses))], losses, label=f'{name}: {len(losses)} records', **style)
        av.plot(range(1, epochs+1), [v[1] for v in learn.recorder.values], label=name, **style)
    ax.set_xlabel('epoch'); ax.set_ylabel('smoothed train loss, as recorded'); ax.legend(fontsize=8)
    ax.set_title('train loss as the Recorder logs it\n(fastai smooths per record: 8x more records, less lag)', fontsize=10)
    av.set_xlabel('epoch'); av.set_ylabel('validation loss'); av.legend(fontsize=8)
    av.set_title('validation loss per epoch', fontsize=10)
    fig.suptitle('digits, fit_one_cycle: the accumulated run is the large-batch run')
    fig.tight_layout(); fig.savefig(out/'loss_curves.png', dpi=110)
    print(f"\nsaved {out/'loss_curves.png'}")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', type=Path, default=Path('demo/out'))
    p.add_argument('--epochs', type=int, default=20)
    p.add_argument('--accum-bs', type=int, default=256)
    p.add_argument('--micro-bs', type=int, default=32)
    a = p.parse_args()
    main(a.out, a.epochs, a.accum_bs, a.micro_bs)
