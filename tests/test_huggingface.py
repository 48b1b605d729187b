"""The Hugging Face recipe (nbs/examples.huggingface.ipynb) with transformers' own GPT2LMHeadModel, built from a config
(no download): dict batches, labels of -100 on padding, `normalize_by='auto'`; accumulated micro-batches of 8 end
with the weights of batches of 32 (float64, 1e-8), and counting samples instead does not. `transformers` is pinned in
both lock files: this test runs in both environments, never skipped."""
import json, os, sys
from pathlib import Path
import torch
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import text_lines, encode, VOCAB, Float64SmoothLoss, max_param_diff

def page_recipe()->dict:
    "The recipe's code as the page shows it: the cells that define `causal_lm_collate` and `CausalLMLogits`"
    cells = json.loads((Path(__file__).parents[1]/'nbs'/'examples.huggingface.ipynb').read_text())['cells']
    ns = {}
    exec('from fastai.basics import *', ns)
    for c in cells:
        src = ''.join(c['source'])
        if c['cell_type'] == 'code' and ('def causal_lm_collate' in src or 'class CausalLMLogits' in src): exec(src, ns)
    return ns

R = page_recipe()
causal_lm_collate,CausalLMLogits = R['causal_lm_collate'],R['CausalLMLogits']
sys.modules.setdefault('torchvision', None) # transformers would import the broken CUDA torchvision (see NOTES)
os.environ.setdefault('HF_HUB_OFFLINE', '1') # the model is built from a config: nothing is downloaded
import transformers

def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0., embd_pdrop=0., attn_pdrop=0.)
    return transformers.GPT2LMHeadModel(cfg).double()

def learner(bs, cbs=None):
    lines = text_lines(160)
    train,valid = [[{'input_ids': torch.tensor(encode(l))} for l in ls] for ls in (lines[:128], lines[128:])]
    dls = DataLoaders(FastaiDataLoader(train, bs=bs, create_batch=causal_lm_collate, device='cpu'),
                      FastaiDataLoader(valid, bs=32, create_batch=causal_lm_collate, device='cpu'), device='cpu')
    return Learner(dls, CausalLMLogits(gpt2()), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.5,
                   cbs=[Float64SmoothLoss()] + L(cbs))

def fit(learn):
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    return learn

def test_gpt2_dict_batches_match_the_large_batch(capsys):
    large = fit(learner(32))
    accum = fit(learner(8, GradientAccumulation(32)))
    samples = fit(learner(8, GradientAccumulation(32, normalize_by='samples')))
    assert "TokenCount(ignore_index=-100)" in capsys.readouterr().out # what 'auto' read from the loss
    test_eq(len(accum.recorder.losses), 4)
    d_auto,d_samples = max_param_diff(large, accum),max_param_diff(large, samples)
    print(f"GPT2LMHeadModel: max |weight diff| 'auto' {d_auto:.1e}, 'samples' {d_samples:.1e}")
    assert d_auto < 1e-8 < d_samples, (d_auto, d_samples)
    test_close(accum.recorder.losses, large.recorder.losses, eps=1e-8)
