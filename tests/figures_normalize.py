"""Print the figures of issue 17: accumulation with no `normalize_by` argument on a padded causal language model and on
class-weighted cross-entropy, against the large batch, in float64. Not a test (pytest does not collect it). It measures
whichever `fastxtend_accum` is first on the path, with this tree's helpers (`test_utils.py`, loaded from its file), so
the same script prints the figures of an older checkout too:

    PYTHONPATH=. .venv/bin/python tests/figures_normalize.py                 # this tree
    PYTHONPATH=/path/to/old/checkout .venv/bin/python tests/figures_normalize.py   # another version of the library

The GPT-2 line needs `transformers` (pinned in both lock files)."""
import importlib.util, inspect, sys, warnings
from pathlib import Path
import torch
from fastai.basics import *
import fastxtend_accum
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching

spec = importlib.util.spec_from_file_location(
    'tree_test_utils', Path(__file__).resolve().parents[1] / 'fastxtend_accum' / 'test_utils.py'
)
tu = importlib.util.module_from_spec(spec); spec.loader.exec_module(tu)

MICRO,ACCUM,N_LINES = 8,32,448 # GradientAccumulation(32) on micro-batches of 8: 448 lines make 14 steps
WEIGHTS = torch.linspace(0.2, 2., 10, dtype=torch.float64) # class weights for digits' 10 classes

def quiet_fit(learn, n_epoch=1):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(n_epoch)
    learn.warned = [str(w.message) for w in ws]
    return learn

def lm(bs, loss_func, cbs=()):
    return quiet_fit(
        tu.text_learner(bs, n=N_LINES, model=tu.CausalLM(), loss_func=loss_func, lr=0.1, cbs=[tu.FirstStepGrad(), *cbs])
    )


def weighted(bs, loss_func, cbs=()):
    return quiet_fit(tu.digits_learner(bs, cbs=[tu.FirstStepGrad(), *cbs], loss_func=loss_func), 2)

def compare(name, large, other):
    g,h = large.first_step_grad.grad,other.first_step_grad.grad
    rel,cos = ((h-g).norm()/g.norm()).item(),torch.nn.functional.cosine_similarity(g, h, dim=0).item()
    print(
        f'{name:<62} first step: gradient {rel:.2e} off (cosine {cos:.6f}); after {len(large.recorder.losses):>2} '
        f'steps: max |weight diff| {tu.max_param_diff(large, other):.1e}'
        + (f'; warned: {other.warned[0][:60]}...' if other.warned else '')
    )


def gpt2_model():
    ("Hugging Face's GPT-2 from a config (random weights, no dropout), float64, logits as (batch, vocab, length); "
     "None without transformers")
    sys.modules.setdefault('torchvision', None) # transformers would import the broken CUDA torchvision
    try: import transformers
    except ImportError: return None
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=tu.VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    class GPT2Logits(nn.Module):
        def __init__(self): super().__init__(); self.gpt2 = transformers.GPT2LMHeadModel(cfg).double()
        def forward(self, x): return self.gpt2(input_ids=x).logits.transpose(1, 2)
    return GPT2Logits()

def main():
    torch.set_num_threads(1)
    default = inspect.signature(GradientAccumulation).parameters.get('normalize_by')
    print(
        f'fastxtend_accum from {Path(fastxtend_accum.__file__).parent}: normalize_by defaults to {default.default!r}\n'
    )
    # labels padded with -100, the losses' default ignore_index
    ce,flat = nn.CrossEntropyLoss(),CrossEntropyLossFlat(axis=1)
    large = lm(ACCUM, ce)
    compare(
        'padded causal LM, CrossEntropyLoss, GradientAccumulation(32)',
        large,
        lm(MICRO, ce, [GradientAccumulation(ACCUM)]),
    )
    compare(
        'padded causal LM, CrossEntropyLoss, MicroBatching(8)',
        large,
        lm(ACCUM, ce, [MicroBatching(MICRO, verbose=False)]),
    )
    if gpt2_model() is not None:
        gpt2 = lambda bs, cbs=(): quiet_fit(
            tu.text_learner(bs, n=N_LINES, model=gpt2_model(), loss_func=ce, lr=0.1, cbs=[tu.FirstStepGrad(), *cbs])
        )
        compare(
            "Hugging Face GPT-2, CrossEntropyLoss, GradientAccumulation(32)",
            gpt2(ACCUM),
            gpt2(MICRO, [GradientAccumulation(ACCUM)]),
        )
    else: print('(transformers does not import: no GPT-2 figure)')
    large_flat = lm(ACCUM, flat)
    compare(
        "padded causal LM, fastai's CrossEntropyLossFlat, GradientAccumulation(32)",
        large_flat,
        lm(MICRO, flat, [GradientAccumulation(ACCUM)]),
    )
    for name, lf in [
        ('CrossEntropyLoss(weight=w)', nn.CrossEntropyLoss(weight=WEIGHTS)),
        # it computes in float32
        ("fastai's CrossEntropyLossFlat(weight=w)", CrossEntropyLossFlat(weight=WEIGHTS.float())),
        ('CrossEntropyLoss(weight=w, label_smoothing=0.1)', nn.CrossEntropyLoss(weight=WEIGHTS, label_smoothing=0.1)),
    ]:
        large = weighted(64, lf)
        compare(f'digits, {name}, GradientAccumulation(64)', large, weighted(16, lf, [GradientAccumulation(64)]))
        compare(f'digits, {name}, MicroBatching(16)', large, weighted(64, lf, [MicroBatching(16, verbose=False)]))
    large = quiet_fit(tu.text_learner(ACCUM, n=N_LINES))
    plain = quiet_fit(tu.text_learner(MICRO, n=N_LINES, cbs=[GradientAccumulation(ACCUM)]))
    print(
        f'\nchar GRU, plain-function token-mean loss (unreadable), GradientAccumulation(32): max |weight diff| '
        f'{tu.max_param_diff(large, plain):.1e}, warnings: {len(plain.warned)}'
        + (f': {plain.warned[0]}' if plain.warned else '')
    )


if __name__ == '__main__': main()
