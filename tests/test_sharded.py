"""Two processes (torchrun, gloo, CPU) training sharded in fastai's idiom (`learn.sharded_ctx()`, FSDP2 and FSDP1) reach
the parameters and optimizer state of one process training on the same global windows, in float64; checkpoints are plain
state dicts; a model the user sharded keeps working. The workers are `sharded_worker.py`; the `before` launch shows what
fastai does on a sharded model without this library's `sharded` module."""
import os, re, subprocess
from copy import deepcopy
import pytest, torch
pytestmark = [pytest.mark.multiprocess]
from fastai.basics import *
from fastai.callback.training import GradientClip
from fastai.callback.tracker import SaveModelCallback
import sharded_worker as W
from test_distributed import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, 'sharded_worker.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
TIMEOUT = 600  # seconds for a whole launch (2 loaded cores); a collective that hangs fails after `W.PG_TIMEOUT` seconds


def launch(out, cases, before=False):
    "Run the cases on 2 processes under torchrun (bounded); what each rank wrote, by case"
    cmd = torchrun(2, WORKER, out, ','.join(cases), max_restarts=0)
    env = dict(ENV, FXA_BEFORE='1') if before else ENV
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=os.path.dirname(HERE))
    errors = '\n'.join(l for l in p.stderr.splitlines() if re.search(r'\[rank\d\]: \S*(Error|Exception)\b', l))
    assert p.returncode == 0, p.stdout[-3000:] + '\n' + errors[-4000:] + '\n' + p.stderr[-3000:]
    return {c: [torch.load(out/f'{c}-rank{r}.pt', weights_only=False) for r in range(2)] for c in cases}

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('sharded')
    return launch(out, W.CASES),out

@pytest.fixture(scope='module')
def before(tmp_path_factory):
    return launch(tmp_path_factory.mktemp('before'), W.BEFORE_CASES, before=True)

class EpochWindows:
    "A batch sampler that yields epoch e's global windows on its e-th pass"
    def __init__(self, epochs): self.epochs,self.i = epochs,0
    def __len__(self): return len(self.epochs[min(self.i, len(self.epochs)-1)])
    def __iter__(self):
        ws = self.epochs[self.i]; self.i += 1
        return iter(ws)

def global_fits(ranks_batches):
    """Per fit, per epoch, the global windows: window w holds every process's micro-batches of its window w, process by
    process (the samples one process would train on in one step); as (samples, batch sampler)"""
    fits = {}
    for key in dict.fromkeys(b[:3] for b in ranks_batches[0]):
        xs = [(x, y) for batches in ranks_batches for (f,e,w,x,y) in batches if (f,e,w) == key]
        fits.setdefault(key[0], {}).setdefault(key[1], []).append(xs)
    out = []
    for f in sorted(fits):
        samples,epochs = [],[]
        for e in sorted(fits[f]):
            ws = []
            for mbs in fits[f][e]:
                start = len(samples)
                for x,y in mbs: samples += list(zip(x, y))
                ws.append(list(range(start, len(samples))))
            epochs.append(ws)
        out.append((samples, EpochWindows(epochs)))
    return out

def reference(res, opt='adam', n_epochs=(2,), cbs=(), with_save=False, path=None, model=None):
    ("One process, no sharding, no accumulation, stepping once per global window, fit after fit; snapshots after each "
     "fit")
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss
    of,lr = W.opt_func(opt)
    _,val = W.digits_samples()
    learn,snaps = None,[]
    for (samples, sampler),n in zip(global_fits([r['batches'] for r in res]), n_epochs):
        dls = DataLoaders(torch.utils.data.DataLoader(samples, batch_sampler=sampler),
                          W.FastaiDataLoader(val, bs=W.MICRO_BS, device='cpu'), device='cpu')
        if learn is None:
            learn = Learner(
                dls,
                model or digits_mlp(seed=0),
                loss_func=nn.CrossEntropyLoss(),
                opt_func=of,
                lr=lr,
                cbs=[Float64SmoothLoss()] + list(cbs),
            )
            if path is not None: learn.path = path
        else: learn.dls = dls
        extra = SaveModelCallback(fname='best', with_opt=True) if with_save else None
        with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(n, cbs=extra)
        snaps.append(
            ([p.detach().clone() for p in learn.model.parameters()], deepcopy(to_device(learn.opt.state_dict(), 'cpu')))
        )
    return learn,snaps

def max_diff(a, b): return max((p-q).abs().max().item() for p,q in zip(a, b))

def opt_diff(a, b)->float:
    "Largest difference between two optimizer state dicts' tensors (fastai's or PyTorch's); inf if their entries differ"
    sa,sb = a['state'],b['state']
    items = (lambda s: list(s.items()) if isinstance(s, dict) else list(enumerate(s)))
    if [(i, sorted(s)) for i,s in items(sa)] != [(i, sorted(s)) for i,s in items(sb)]: return float('inf')
    d = 0.
    for (_,s),(_,t) in zip(items(sa), items(sb)):
        for k in s:
            if isinstance(s[k], Tensor):
                d = max(d, (s[k].double() - t[k].double()).abs().max().item() if s[k].numel() else 0.0)
            elif s[k] != t[k]: return float('inf')
    return d

def check_plain(r):
    assert r['model_type'] == 'Sequential' and r['param_types'] == ['Parameter'], (r['model_type'], r['param_types'])

@pytest.mark.parametrize('case,opt,n_epochs', [('fsdp2_adam', 'adam', (2, 2)), ('fsdp1_adam', 'adam', (1, 1))])
def test_two_fits_match_one_process(runs, case, opt, n_epochs):
    ("Fit after fit: the parameters and the optimizer's moments (moved to the shards and back each fit) equal one "
     "process's")
    res,_ = runs
    r0,r1 = res[case]
    _,snaps = reference(res[case], opt, n_epochs, cbs=[GradientClip(W.MAX_NORM)])
    for r in (r0, r1):
        check_plain(r); check_plain(r['fit1'])
        d1,d2 = max_diff(r['fit1']['params'], snaps[0][0]),max_diff(r['params'], snaps[1][0])
        o1,o2 = opt_diff(r['fit1']['opt'], snaps[0][1]),opt_diff(r['opt'], snaps[1][1])
        print(f'{case}: max |param diff| vs one process on the global windows: fit 1 {d1:.3g}, fit 2 {d2:.3g}; '
              f'optimizer state {o1:.3g}, {o2:.3g}')
        assert max(d1, d2, o1, o2) < 1e-8
    if case == 'fsdp2_adam': assert r0['same_model'] and r1['same_model'] # the module the user passed, trained

def test_fsdp1_fastai_sgd_clips_on_the_global_norm(runs):
    ("fastai's SGD steps FSDP1's views; GradientClip clips by the norm of the whole gradient, which each process's "
     "part is not")
    res,_ = runs
    _,snaps = reference(res['fsdp1_sgd'], 'sgd', (2,), cbs=[GradientClip(W.MAX_NORM)])
    for r in res['fsdp1_sgd']:
        check_plain(r)
        d = max_diff(r['params'], snaps[0][0])
        print(f'fsdp1_sgd: max |param diff| {d:.3g}; optimizer state {opt_diff(r["opt"], snaps[0][1]):.3g}')
        assert d < 1e-8 and opt_diff(r['opt'], snaps[0][1]) < 1e-8
    (l0,w0),(l1,w1) = [r['norms'] for r in res['fsdp1_sgd']]
    # the same whole norm on both processes, and it clips
    assert w0 == pytest.approx(w1, rel=1e-12) and w0[0] > W.MAX_NORM
    print(f'first step: norm of each process part {l0[0]:.3g} and {l1[0]:.3g}, of the whole gradient {w0[0]:.3g}')
    assert abs(l0[0] - w0[0]) > 0.01 and abs(l1[0] - w0[0]) > 0.01

def test_per_shard_clipping_is_off(runs):
    ("The test has teeth: clipping each process's part by its own norm (fastai's GradientClip before this library) is "
     "off")
    res,_ = runs
    _,snaps = reference(res['fsdp1_shardclip'], 'sgd', (2,), cbs=[GradientClip(W.MAX_NORM)])
    d = max_diff(res['fsdp1_shardclip'][0]['params'], snaps[0][0])
    print(f'fsdp1, each part clipped by its own norm: max |param diff| {d:.3g}')
    assert d > 1e-4

def test_torch_optimizer_and_microbatching(runs):
    "PyTorch's AdamW in OptimWrapper, `MicroBatching` splitting each process's batch of 32 into micro-batches of 8"
    res,_ = runs
    _,snaps = reference(res['fsdp2_adamw_microbatch'], 'adamw', (2,), cbs=[GradientClip(W.MAX_NORM)])
    for r in res['fsdp2_adamw_microbatch']:
        check_plain(r)
        d,o = max_diff(r['params'], snaps[0][0]),opt_diff(r['opt'], snaps[0][1])
        print(f'fsdp2_adamw_microbatch: max |param diff| {d:.3g}; optimizer state {o:.3g}')
        assert d < 1e-8 and o < 1e-8

def test_checkpoints_are_plain_and_lr_find_restores(runs, tmp_path):
    """`lr_find` leaves the model and optimizer as they were; `SaveModelCallback` (a collective save, in the fit) writes
    one plain checkpoint that fastai's `learn.load` reads on one process, and loads the best epoch at the end, as one
    process does"""
    res,out = runs
    r0,r1 = res['save_load']
    for r in (r0, r1):
        assert max_diff(r['after_lr_find'], r['start']) == 0
        assert all('grad_avg' not in s for s in r['opt_after_lr_find']['state']) # no moments: the optimizer as it was
        assert r['lr_find'] > 0
    assert r0['valid_losses'] == r1['valid_losses'] # gathered over the processes: both decide the same
    ref,snaps = reference(res['save_load'], 'adam', (3,), with_save=True, path=tmp_path)
    test_close(r0['valid_losses'], [float(v[1]) for v in ref.recorder.values], eps=1e-10)
    with ref.no_logging(), ref.no_bar(): v = float(ref.validate()[0])
    assert r0['validate'] == r1['validate'] and abs(r0['validate'] - v) < 1e-10
    for r in (r0, r1):
        check_plain(r)
        assert max_diff(r['params'], snaps[0][0]) < 1e-8 and opt_diff(r['opt'], snaps[0][1]) < 1e-8
    models = out/'save_load'/'models'
    assert sorted(os.listdir(models)) == ['best.pth'] # lr_find's temporary checkpoints are gone
    state = torch.load(models/'best.pth', weights_only=False)
    ref_state = torch.load(tmp_path/'models'/'best.pth', weights_only=False)
    assert set(state) == {'model', 'opt'} and list(state['model']) == list(ref_state['model'])
    d = max((state['model'][k] - v).abs().max().item() for k,v in ref_state['model'].items())
    print(
        f'save_load: the checkpoint against one process: model {d:.3g}, optimizer '
        f'{opt_diff(state["opt"], ref_state["opt"]):.3g}'
    )
    assert d < 1e-8 and opt_diff(state['opt'], ref_state['opt']) < 1e-8
    from fastxtend_accum.test_utils import digits_mlp

    learn = Learner(
        DataLoaders(device='cpu'),
        digits_mlp(seed=1),
        loss_func=nn.CrossEntropyLoss(),
        opt_func=Adam,
        path=out / 'save_load',
    )
    learn.load('best', device='cpu') # fastai's own load, one process
    assert max_diff([p.detach() for p in learn.model.parameters()], r0['params']) < 1e-12

def test_user_sharded_model_in_the_context(runs):
    ("A model sharded with fully_shard before the Learner: the context shares the data out and leaves the shards; "
     "save/load round trip")
    res,out = runs
    r0,r1 = res['user_fsdp2_ctx']
    assert r0['sharded_after'] and r1['sharded_after']
    _,snaps = reference(res['user_fsdp2_ctx'], 'adam', (2,), cbs=[GradientClip(W.MAX_NORM)])
    from fastxtend_accum.test_utils import digits_mlp
    start = [p.detach() for p in digits_mlp(seed=0).parameters()]
    for r in (r0, r1):
        d = max_diff(r['params'], snaps[0][0])
        print(f'user_fsdp2_ctx: max |param diff| {d:.3g}')
        assert d < 1e-8
        assert max_diff(r['reloaded_start'], start) == 0 and max_diff(r['reloaded_end'], r['params']) == 0
    end = torch.load(out/'user'/'models'/'end.pth', weights_only=False)
    assert max_diff(list(end['model'].values()), snaps[0][0]) < 1e-8 and opt_diff(end['opt'], snaps[0][1]) < 1e-8

def test_user_fsdp1_model_by_hand(runs):
    ("FSDP1 before the Learner, per-process loaders split by hand, fastai's SGD and GradientClip, no context: exact; "
     "saves whole")
    res,out = runs
    _,snaps = reference(res['user_fsdp1_by_hand'], 'sgd', (2,), cbs=[GradientClip(W.MAX_NORM)])
    end = torch.load(out/'user1'/'models'/'end.pth', weights_only=False)
    d = max_diff(list(end['model'].values()), snaps[0][0])
    print(f'user_fsdp1_by_hand: max |param diff| {d:.3g}; optimizer state {opt_diff(end["opt"], snaps[0][1]):.3g}')
    assert d < 1e-8 and opt_diff(end['opt'], snaps[0][1]) < 1e-8

def test_context_starts_and_ends_the_group(tmp_path):
    "Under torchrun with no process group yet, `sharded_ctx(cpu=True)` joins one (gloo) for its fits and ends it after"
    res = launch(tmp_path, ['ctx_starts_group'])
    _,snaps = reference(res['ctx_starts_group'], 'adam', (1,))
    for r in res['ctx_starts_group']:
        assert r['backend'] == 'gloo' and not r['group_after']
        assert max_diff(r['params'], snaps[0][0]) < 1e-8

# --- before: fastai on a sharded model, without this library's `sharded` module
def test_before_distrib_ctx_fails(before):
    for r in before['before_distrib_ctx']:
        print(f'before, distrib_ctx on a sharded model: {r["error"]}')
        assert r['error'] is not None

def test_before_sharding_in_before_fit_trains_nothing(before):
    for r in before['before_prepare']:
        print(f'before, sharding in before_fit: parameters moved by {r["moved"]:.3g}; after_fit: {r["error"]}')
        assert r['moved'] == 0 and "has no attribute 'module'" in r['error']

def test_before_fastai_optimizer_on_fsdp1(before):
    for r in before['before_fastai_opt_fsdp1']:
        print(f'before, fastai SGD on FSDP1: {r["error"]}')
        assert "Can't detach views in-place" in r['error']

def test_before_gradient_clip_on_fsdp1(before):
    (l0,w0),(l1,w1) = [r['norms'] for r in before['before_clip_fsdp1']]
    print(
        f'before, GradientClip on FSDP1, first step: each process clips by the norm of its part, {l0[0]:.3g} and '
        f'{l1[0]:.3g}, where the whole gradient has {w0[0]:.3g}'
    )
    assert abs(l0[0] - w0[0]) > 0.01

# ---- tied weights (issue 24)
@pytest.fixture(scope='module')
def tied(tmp_path_factory):
    return launch(tmp_path_factory.mktemp('tied'), W.TIED_CASES)

@pytest.mark.parametrize('case,opt', [('tied_fsdp2', 'adam'), ('tied_fsdp1', 'sgd')])
def test_tied_weights_default_policy(tied, case, opt):
    """Layers 0 and 2 share one weight: the default policy keeps both in the root's block, and the run equals one
    process (no sharding) on the same global windows; after the fit the user's model is plain and still tied"""
    _,snaps = reference(tied[case], opt, (2,), model=W.tied_mlp())
    for r in tied[case]:
        check_plain(r)
        d,o = max_diff(r['params'], snaps[0][0]),opt_diff(r['opt'], snaps[0][1])
        print(f'{case}: max |param diff| vs one process on the global windows {d:.3g}, optimizer state {o:.3g}')
        assert max(d, o) < 1e-8 and r['still_tied']
    start = list(W.tied_mlp().parameters())
    assert max_diff(tied[case][0]['params'], start) > 1e-3 # it trained

def test_tied_weights_split_by_a_policy_are_refused(tied):
    ("A policy that shards each Linear apart would split the pair: refused before anything is sharded, saying how to "
     "fix it")
    for r in tied['tied_refused']:
        assert (
            "`0.weight` and `2.weight` are one parameter (tied weights), and the policy shards `0` as a block of its "
            "own without `2`"
        ) in r['error'], r['error']
        assert 'Nothing was sharded' in r['error'] and r['untouched'] and r['group_after']
