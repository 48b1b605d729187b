"""`global_bs=True`: `accum_bs` (a schedule's sizes) count the samples of an optimizer step over all processes. The same
script on one process and on two (torchrun, gloo, CPU) takes the same optimizer steps, with the same samples per step
and the same lr per step; on the same global windows, it ends with the same weights (float64, 1e-8). The worker is
`global_bs_worker.py`; the one-process checks without a launcher are at the end."""
import os, sys, warnings
from collections import Counter
from types import SimpleNamespace
import pytest, torch
from fastai.basics import *
import global_bs_worker as G
from test_distributed import torchrun, run_launch, ENV, TIMEOUT, HERE
from test_loggers import wandb_run, tb_scalars
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
from fastxtend_accum.distributed import default_world_size
from fastxtend_accum.messages import doc_link
from fastxtend_accum.test_utils import digits_learner, digits_mlp, max_param_diff

WORKER = os.path.join(HERE, 'global_bs_worker.py')
def see(id): return f' (see {doc_link(id)})' # the link the library's warnings end with
SEE_SIZE = see('size')
TRAINED = ['ga', 'gas', 'ga_dealt', 'gas_dealt', 'gas_cos_dealt', 'indivisible_dealt', 'gas_indivisible_dealt']
ONE,TWO = TRAINED,TRAINED + ['ga_off', 'gas_below', 'unwrapped']

def run(cmd, env=ENV): return run_launch(cmd, TIMEOUT, env).stdout

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """The worker on one process (`python`, as a user runs a script without a launcher) and on two (torchrun): what each
    rank wrote, by case and world size, and the two-process launch's output"""
    out = tmp_path_factory.mktemp('global_bs')
    run([sys.executable, WORKER, str(out), '1', ','.join(ONE)])
    # a 60 s process-group timeout (not ddp_worker's 20 s): rank 0 alone runs W&B's service in two cases, and on a
    # loaded
    # 2-core machine a process once waited 20 s for the other at a gradient all-reduce; a real hang still fails the
    # launch,
    # bounded by TIMEOUT
    stdout = run(torchrun(2, WORKER, out, '2', ','.join(TWO)), env=dict(ENV, FXA_PG_TIMEOUT='60'))
    res = {c: {1: [torch.load(out/f'{c}-w1-rank0.pt')]} for c in ONE}
    for c in TWO: res.setdefault(c, {})[2] = [torch.load(out/f'{c}-w2-rank{r}.pt') for r in range(2)]
    return res,stdout

def per_epoch(r): return sorted(Counter(e for e,_,_ in r['steps']).items())

# what each case's windows hold over all processes, epoch by epoch (1,024 samples a shuffled epoch; 544 in the `_dealt`
# ones)
EXPECTED = {
    'ga': [128]*8*2,                                     # 8 steps an epoch: 64 micro-batches of 16, or 32 per process
    'gas': [256]*4 + [64]*16,                            # the size jumps from 256 to 64 at epoch 1
    'ga_dealt': ([128]*4 + [32])*2,                      # 544 = 4*128 + 32
    'gas_dealt': [256, 256, 32] + [64]*8 + [32],
    'gas_cos_dealt': [256, 224, 64, 128, 96, 96, 64, 64, 64, 32], # multiples of 2 x 16, what the processes share
    'indivisible_dealt': ([128]*4 + [32])*2,             # accum_bs=100: windows close at the first step past it
    'gas_indivisible_dealt': [128, 128, 128, 160, 192, 224, 128],
}

@pytest.mark.multiprocess
@pytest.mark.parametrize('case', TRAINED)
def test_same_steps_samples_and_lr(runs, case):
    "One process and two: the same optimizer steps in each epoch, the same samples in each, the same lr for each"
    res,_ = runs
    (one,),(r0,r1) = res[case][1],res[case][2]
    held = [n for _,n,_ in one['steps']]
    print(f"{case}: {len(held)} steps, samples per step {held} on one process and on two")
    assert held == EXPECTED[case]
    for r in (r0, r1):
        assert per_epoch(r) == per_epoch(one)
        assert [n for _,n,_ in r['steps']] == held # held_bs: the window's samples over all processes
        assert [lr for _,_,lr in r['steps']] == pytest.approx([lr for _,_,lr in one['steps']], rel=1e-12, abs=0)
        assert r['lrs'] == pytest.approx(one['lrs'], rel=1e-12, abs=0) and len(r['lrs']) == len(held)
        if case.startswith('gas'): assert r['hps_accum_bs'] == one['hps_accum_bs'] == held # the Recorder's record
    assert len(set(lr for _,_,lr in one['steps'])) > len(held)//2 # fit_one_cycle: the lr changes from step to step

@pytest.mark.multiprocess
@pytest.mark.parametrize('case', [c for c in TRAINED if c.endswith('_dealt')])
def test_same_global_windows_same_weights(runs, case):
    ("On the same global windows (the two processes' windows are dealt from one process's order, `dealing`), the same "
     "weights")
    res,_ = runs
    (one,),(r0,r1) = res[case][1],res[case][2]
    d = max(float((p-q).abs().max()) for p,q in zip(r0['params'], one['params']))
    moved = max(float((p-q.detach()).abs().max()) for p,q in zip(one['params'], digits_mlp(seed=0).parameters()))
    print(f'{case}: max |param diff| two processes vs one {d:.3g} (the weights moved {moved:.3g} in training)')
    assert d < 1e-8 and moved > 1e-3
    assert max(float((p-q).abs().max()) for p,q in zip(r0['params'], r1['params'])) < 1e-12
    assert r0['losses'] == pytest.approx(one['losses'], rel=0, abs=1e-10) # rank 0 logs the global window's loss

@pytest.mark.multiprocess
def test_world_size_is_known_at_before_fit(runs):
    """The world size the sizes are planned with at `before_fit` (torch.distributed's default group, before fastai's
    DistributedTrainer wraps the model) is the engine's at `before_train`; lr_find's `epochs_for`, asked after the wrap,
    counts the per-process windows: 10 steps of 8 a epoch need 2 epochs on one process and on two"""
    res,_ = runs
    for case in TRAINED:
        (one,),two = res[case][1],res[case][2]
        assert (one['ws_fit'], one['ws_train']) == (1, [(1, 1, 'Sequential')]*G.N_EPOCH)
        for r in two:
            assert r['wrapped_at_fit'] == 'Sequential' # not wrapped yet at the callback's before_fit
            assert (r['ws_fit'], r['ws_train']) == (2, [(2, 2, 'DistributedDataParallel')]*G.N_EPOCH)
    assert res['ga'][1][0]['epochs_for_10'] == res['ga'][2][0]['epochs_for_10'] == res['ga'][2][1]['epochs_for_10'] == 2

@pytest.mark.multiprocess
def test_distrib_ctx_sets_up_the_process_group_before_the_fit(tmp_path):
    """A script that leaves the process group to `distrib_ctx` (fastai's DistributedTrainer builds an `Accelerator`,
    which sets it up when `distrib_ctx` is entered, before `fit`): the world size is known at `before_fit` all the
    same"""
    run(torchrun(2, WORKER, tmp_path, '2', 'ga'), env=dict(ENV, FXA_NO_INIT='1'))
    for r in range(2):
        res = torch.load(tmp_path/f'ga-w2-rank{r}.pt')
        assert (res['ws_fit'], res['wrapped_at_fit'], res['epochs_for_10']) == (2, 'Sequential', 2)
        assert [n for _,n,_ in res['steps']] == EXPECTED['ga']

@pytest.mark.multiprocess
def test_indivisible_message(runs):
    "A global batch the processes cannot share exactly: the library's rule, and a one-time message with both sizes"
    res,_ = runs
    for r in res['indivisible_dealt'][2]:
        assert r['messages'] == [
            "Micro-batches of 16 samples on each of 2 processes do not divide accum_bs=100 over 2 processes "
            "(global_bs=True: 50 per process): windows close at 128 samples over all processes (64 per "
            "process), and each step uses the mean gradient over its window" + SEE_SIZE
        ]
    assert res['indivisible_dealt'][1][0]['messages'] == [
        'Micro-batches of 32 samples do not divide accum_bs=100: windows close '
        'at 128 samples, and each step uses the mean gradient over its window' + SEE_SIZE
    ]
    for r in res['gas_indivisible_dealt'][2]:
        assert r['messages'] == [
            '`start_accum_bs`=100 is not a multiple of the micro-batch size 16 x 2 processes = 32 (global_bs=True): '
            'its windows hold 128 samples (64 per process)' + see('start_accum_bs'),
            '`final_accum_bs`=200 is not a multiple of the micro-batch size 16 x 2 processes = 32 (global_bs=True): '
            'its windows hold 224 samples (112 per process)' + see('final_accum_bs'),
        ]
    for r in res['gas_below'][2]:
        assert (
            '`start_accum_bs`=16 is below the micro-batch size 16 x 2 processes = 32 (global_bs=True): a window holds '
            'at least one micro-batch on each process'
        ) in r['error']

@pytest.mark.multiprocess
def test_a_model_not_trained_over_every_process_raises(runs):
    "A process group of 2 but a model no engine wraps: the global batch cannot be shared, and every process says why"
    res,_ = runs
    for r in res['unwrapped'][2]:
        assert (
            "`global_bs=True` shares accum_bs=128 over the 2 processes of torch.distributed's default process group, "
            "but the model (Sequential) trains on 1"
        ) in r['error'] and r['steps'] == []

@pytest.mark.multiprocess
def test_rank_0_prints_the_global_batch_once(runs):
    _,out = runs
    lines = [l for l in out.splitlines() if 'samples per optimizer step' in l]
    link = f" (see {doc_link('global-bs')})"
    g = lambda name, bs: (
        f'{name}: accum_bs={bs} samples per optimizer step (global_bs=True) = {bs // 2} samples per process x 2 '
        f'processes{link}'
    )
    GA,GAS = 'GradientAccumulation','GradientAccumulationSchedule'
    assert lines == [g(GA, 128), g(GAS, 256), g(GA, 128), g(GAS, 256), g(GAS, 256), g(GA, 100), g(GAS, 100),
                     # ga_off
                     f'{GA}: accum_bs=64 samples per process x 2 processes = 128 samples per optimizer step{link}']

def logged(res, case, world):
    r = res[case][world][0]
    rows,_ = wandb_run(SimpleNamespace(settings=SimpleNamespace(sync_dir=r['wandb_dir'])))
    tb = tb_scalars(Path(r['wandb_dir']).parents[2]/f'tb-{case}-w{world}')
    return [o['accum_bs'] for o in rows if 'train_loss' in o],[v for _,v in tb['accum_bs']],r

@pytest.mark.multiprocess
def test_loggers_log_the_global_accum_bs(runs):
    "W&B and TensorBoard (rank 0) log what each window held over all processes: the same on one process and on two"
    res,_ = runs
    wb1,tb1,r1 = logged(res, 'gas', 1)
    wb2,tb2,r2 = logged(res, 'gas', 2)
    assert wb1 == tb1 == wb2 == tb2 == r1['hps_accum_bs'] == r2['hps_accum_bs'] == EXPECTED['gas']
    # accum_bs per process (global_bs=False) on two processes: the step's global batch is logged, 2 x 64
    wb,tb,r = logged(res, 'ga_off', 2)
    assert wb == tb == [n for _,n,_ in r['steps']] == [128]*16

# ---- one process, no launcher ----
def fit(cb, bs=16, **kw):
    learn = digits_learner(bs, n_train=500, cbs=cb)
    with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(2, 0.1, **kw)
    return learn

@pytest.mark.parametrize('make', [lambda g: GradientAccumulation(64, global_bs=g),
                                  lambda g: GradientAccumulationSchedule(32, 128, finish=0.5, global_bs=g)])
def test_one_process_global_is_local(make):
    "On one process (no process group) the global batch is the process's: the flag changes nothing, bit for bit"
    assert default_world_size() == 1
    a,b = fit(make(False)),fit(make(True))
    assert max_param_diff(a, b) == 0
    assert (
        torch.equal(torch.stack(a.recorder.losses), torch.stack(b.recorder.losses)) and a.recorder.lrs == b.recorder.lrs
    )
    assert a.recorder.hps.get('accum_bs') == b.recorder.hps.get('accum_bs')

def test_one_process_indivisible_keeps_its_message():
    "One process: the message is the library's, with the per-process words left out"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        fit(GradientAccumulation(100, global_bs=True))
    assert [str(o.message) for o in w if 'divide' in str(o.message)] == [
        'Micro-batches of 16 samples do not divide accum_bs=100: windows close at 112 samples, and each step uses the '
        'mean gradient over its window' + SEE_SIZE
    ]

def test_bad_flag():
    for make in (
        lambda: GradientAccumulation(64, global_bs='yes'),
        lambda: GradientAccumulationSchedule(32, 64, global_bs=1),
    ):
        with pytest.raises(ValueError, match='`global_bs` must be True or False'): make()
