"""Token-count normalization on real text: accumulating padded, uneven micro-batches of a char-level language model gives
the parameters and losses of the large batch's token mean, in float64; the per-micro-batch mean does not"""
import torch
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.normalize import TokenCount
from fastxtend_accum.test_utils import max_param_diff
from fastxtend_accum.test_utils import text_learner, text_samples, text_dl, IGNORE

MICRO_BS,ACCUM_BS,N_EPOCH = 16,64,2 # 300 lines: micro-batches of 16 end with one of 12, windows of 64 with one of 44

def fit(learn):
    with learn.no_logging(), learn.no_bar(): learn.fit(N_EPOCH)
    return learn

def test_micro_batches_are_uneven():
    "The test has teeth only if the micro-batches' token counts differ, and their padding too"
    counts,pads = zip(*[((y != IGNORE).sum().item(), (y == IGNORE).sum().item()) for _,y in text_dl(text_samples(300), MICRO_BS)])
    print(f'tokens per micro-batch: {min(counts)} to {max(counts)}; padding targets: {min(pads)} to {max(pads)}')
    assert max(counts) > 1.5*min(counts) and min(pads) > 0

def test_token_mean_matches_large_batch():
    large = fit(text_learner(ACCUM_BS))
    accum = fit(text_learner(MICRO_BS, cbs=[GradientAccumulation(ACCUM_BS, normalize_by=TokenCount(ignore_index=IGNORE))]))
    naive = fit(text_learner(MICRO_BS, cbs=[GradientAccumulation(ACCUM_BS)])) # each micro-batch weighted by its samples
    d_tokens,d_naive = max_param_diff(large, accum),max_param_diff(large, naive)
    print(f'max |param diff| vs the large batch: TokenCount {d_tokens:.3g}, samples (per-micro-batch mean) {d_naive:.3g}')
    assert d_tokens < 1e-8
    assert d_naive > 1e-4
    assert accum.gradient_accumulation.n_steps == len(large.recorder.losses) == 10
    # the recorded losses are those of the large batch: token means over each window
    assert torch.allclose(torch.stack(accum.recorder.losses), torch.stack(large.recorder.losses), rtol=0, atol=1e-10)
    assert not torch.allclose(torch.stack(naive.recorder.losses), torch.stack(large.recorder.losses), rtol=0, atol=1e-4)
