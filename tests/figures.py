"""Print the figures behind the workflow tests (issue 9), measured on the runs `test_workflows.py` makes: the largest
parameter difference from the large batch for every fit method, `fine_tune` and `lr_find` on real data. Not a test
(pytest does not collect it): `PYTHONPATH=. .venv/bin/python tests/figures.py` from the repository's root."""

import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_workflows import *

def loss_diff(a, b): return (torch.stack(a.recorder.losses)-torch.stack(b.recorder.losses)).abs()

def main():
    torch.set_num_threads(1)
    diffs = {}
    for data,bs in [('digits', 64), ('tabular', 96)]:
        for name,fit in FITS.items():
            large = MAKERS[data](bs); quiet(large, fit)
            accum = MAKERS[data](16, GradientAccumulation(bs)); quiet(accum, fit)
            diffs[f'{data} {name}'] = max_param_diff(large, accum)
    for k,v in diffs.items(): print(f'{k:<26} max |param diff| vs the large batch {v:.1e}')
    for cb in ('accum', 'micro'):
        large = lm_learn(64); quiet(large, lambda l: l.fine_tune(1, 1e-2, freeze_epochs=1))
        other = (
            lm_learn(16, GradientAccumulation(64)) if cb == 'accum' else lm_learn(64, MicroBatching(16, verbose=False))
        )
        quiet(other, lambda l: l.fine_tune(1, 1e-2, freeze_epochs=1))
        print(f'AWD_LSTM fine_tune, {cb:<5}   max |param diff| vs the large batch {max_param_diff(large, other):.1e}')
    for window in (2, 8):
        for num_it in (6, 20, 100):
            large,accum = digits_learn(16*window),digits_learn(16, GradientAccumulation(16*window))
            rl,ra = lr_find(large, num_it),lr_find(accum, num_it)
            d = loss_diff(accum, large)
            print(
                f'lr_find digits, window {window}, num_it {num_it:>3}: {len(accum.recorder.lrs)} records (large batch '
                f'{len(large.recorder.lrs)}), loss diff {d[:-5].max():.1e} (last 5 points {d[-5:].max():.1e}), '
                f'suggestions equal: {list(ra) == list(rl)}, valley {ra.valley:.3e}'
            )
    for cb,make in [('accum', lambda: lm_learn(16, GradientAccumulation(64))),
                    ('schedule', lambda: lm_learn(16, GradientAccumulationSchedule(64, 128, finish=0.5))),
                    ('micro', lambda: lm_learn(64, MicroBatching(16, verbose=False)))]:
        large,other = lm_learn(64),make()
        rl,ro = lr_find(large, 20),lr_find(other, 20)
        print(f'lr_find AWD_LSTM, {cb:<8}: loss diff {loss_diff(other, large).max():.1e}, valley {ro.valley:.3e} '
              f'(large batch {rl.valley:.3e})')
    large,accum = tabular_learn(96),tabular_learn(16, GradientAccumulation(96))
    rl,ra = lr_find(large, 30),lr_find(accum, 30)
    print(f'lr_find tabular: loss diff {loss_diff(accum, large).max():.1e}, suggestions equal: {list(ra) == list(rl)}')

if __name__ == '__main__': main()
