"""One process of a 2-process sharded run (gloo, CPU, float64), started by `test_sharded.py` as
`python -m torch.distributed.run --nproc_per_node=2 tests/sharded_worker.py OUT_DIR [CASES]`.

Each case trains the digits MLP the way a user would (fastai's default loaders: shuffled, `drop_last=True`), records the
micro-batches this process trained on, window by window, and writes `OUT_DIR/<case>-rank<r>.pt`: the test trains one
process on the same global windows and compares. The `before_*` cases show what fastai does without this library's
`sharded` module: they must run in a launch that never imports it (`FXA_BEFORE=1`), since importing it patches
fastai."""

import os, sys
from datetime import timedelta
from copy import deepcopy
from functools import partial
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
from fastai.callback.training import GradientClip
from fastai.callback.tracker import SaveModelCallback
from fastai.data.load import DataLoader as FastaiDataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ddp_worker import fastai_distributed

BEFORE = os.environ.get('FXA_BEFORE') == '1'
# patches fastai's Optimizer.zero_grad, GradientClip, Learner.save/load
if not BEFORE: from fastxtend_accum.sharded import *
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching
from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples

# seconds a collective may wait before the run fails (gloo's default is 30 minutes); the machine may be loaded
PG_TIMEOUT = int(os.environ.get('FXA_PG_TIMEOUT', 120))
MICRO_BS,ACCUM_BS,N_TRAIN,N_VALID = 16,32,320,64 # 160 samples a process: 10 micro-batches, 5 windows of 32 an epoch
MAX_NORM = 0.2 # below the gradient's norm on most steps here: clipping changes the run
ADAM_LR,SGD_LR = 1e-2,0.1

def digits_samples():
    x,y = digits_data()
    return Samples(zip(x[:N_TRAIN], y[:N_TRAIN])),Samples(zip(x[-N_VALID:], y[-N_VALID:]))

def default_dls(bs=MICRO_BS):
    "fastai's default loaders over digits: a shuffled training loader that drops its last partial batch"
    set_seed(0)
    trn,val = digits_samples()
    # no worker processes (fastai starts one per CPU), as in ddp_worker.py: one full run of this file, on a loaded
    # machine,
    # hung with process 1 waiting in an all-gather that process 0 never joined; forking workers from a process that
    # holds a gloo group is the likeliest cause we could not rule out (not reproduced in 20 runs since)
    return DataLoaders.from_dsets(trn, val, bs=bs, device='cpu', num_workers=0)

def opt_func(name):
    if name == 'sgd': return partial(SGD, mom=0.9, wd=1e-2),SGD_LR
    if name == 'adam': return Adam,ADAM_LR
    if name == 'adamw': return partial(OptimWrapper, opt=torch.optim.AdamW),ADAM_LR
    raise ValueError(name)

class Seen(Callback):
    "Record the training micro-batches this process saw: (fit, epoch, window or batch, xb, yb)"
    order = 100
    run_valid = False
    def __init__(self): self.batches,self.fit = [],-1
    def before_fit(self):
        if not hasattr(self.learn, 'lr_finder'): self.fit += 1
    def before_batch(self):
        if hasattr(self.learn, 'lr_finder'): return
        ga = getattr(self.learn, 'gradient_accumulation', None)
        w = ga.windows.i_window if ga is not None else self.iter
        self.batches.append(
            (self.fit, self.epoch, w, self.xb[0].detach().cpu().clone(), self.yb[0].detach().cpu().clone())
        )


class Norms(Callback):
    "At each step: the norm of this process's own gradients, and of the whole gradient (before clipping)"
    order = GradientClip.order-1
    def __init__(self): self.local,self.whole = [],[]
    def before_step(self):
        grads = [
            p.grad.to_local() if hasattr(p.grad, 'to_local') else p.grad
            for p in self.model.parameters()
            if p.grad is not None
        ]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.float64)
        tot = sq.clone()
        dist.all_reduce(tot)
        self.local.append(sq.sqrt().item()); self.whole.append(tot.sqrt().item())

class ShardClip(GradientClip):
    ("fastai's GradientClip as it was: `clip_grad_norm_` on the parameters this process holds (under FSDP1, its own "
     "parts)")

    def before_step(self): nn.utils.clip_grad_norm_(self.parameters(), self.max_norm, self.norm_type)

def tied_mlp():
    ("An MLP with tied weights: layers 0 and 2 share one 64x64 matrix (as an embedding and the output layer share "
     "theirs)")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    m[2].weight = m[0].weight
    return m

def learner(opt='adam', bs=MICRO_BS, cbs=(), model=None, dls=None):
    of,lr = opt_func(opt)
    return Learner(
        dls or default_dls(bs),
        model or digits_mlp(seed=0),
        loss_func=nn.CrossEntropyLoss(),
        opt_func=of,
        lr=lr,
        cbs=[Float64SmoothLoss(), Seen()] + list(cbs),
    )

def snapshot(learn):
    "The model's parameters, whole, and what a plain model is (no DTensor, its own class)"
    return dict(params=[p.detach().clone() for p in learn.model.parameters()], model_type=type(learn.model).__name__,
                param_types=sorted({type(p).__name__ for p in learn.model.parameters()}))

def opt_state(learn):
    "A copy of the plain model's optimizer state dict, tensors on the CPU"
    return deepcopy(to_device(learn.opt.state_dict(), 'cpu'))

def fully_shard_user(model):
    "What a user does before building the Learner: fully_shard each Linear, then the root"
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if isinstance(m, nn.Linear): fully_shard(m)
    return fully_shard(model)

def fsdp1_user(model):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                                    device_id=torch.device('cpu'))

def half_dls(rank, bs=MICRO_BS):
    "Per-process loaders split by hand: process r takes its half of the training set, in order"
    trn,val = digits_samples()
    m = N_TRAIN//2
    return DataLoaders(
        FastaiDataLoader(Samples(trn[rank * m : (rank + 1) * m]), bs=bs, device='cpu'),
        FastaiDataLoader(val, bs=64, device='cpu'),
        device='cpu',
    )


def quiet(learn): return learn.no_logging(),learn.no_bar()

def run_case(case, out, rank):
    res = {}
    def fit(learn, *args, **kwargs):
        a,b = quiet(learn)
        with a, b: learn.fit_one_cycle(*args, **kwargs)
    if case == 'fsdp2_adam': # two fits: Adam's moments move to the shards, back, and to the shards again
        learn = learner('adam', cbs=[GradientAccumulation(ACCUM_BS), GradientClip(MAX_NORM)])
        model = learn.model
        with learn.sharded_ctx():
            fit(learn, 2); res['fit1'] = dict(snapshot(learn), opt=opt_state(learn))
            fit(learn, 2)
        res['same_model'] = learn.model is model
    elif case in ('fsdp1_sgd', 'fsdp1_shardclip'):
        clip = ShardClip(MAX_NORM) if case == 'fsdp1_shardclip' else GradientClip(MAX_NORM)
        norms = Norms()
        learn = learner('sgd', cbs=[GradientAccumulation(ACCUM_BS), norms, clip])
        with learn.sharded_ctx(engine='fsdp1'): fit(learn, 2)
        res['norms'] = (norms.local, norms.whole)
    elif case == 'fsdp1_adam': # FSDP1 steps a parameter only on the processes that hold a part of it
        learn = learner('adam', cbs=[GradientAccumulation(ACCUM_BS), GradientClip(MAX_NORM)])
        with learn.sharded_ctx(engine='fsdp1'):
            fit(learn, 1); res['fit1'] = dict(snapshot(learn), opt=opt_state(learn))
            fit(learn, 1)
    # PyTorch's AdamW in OptimWrapper; batches of 32 split into micro-batches of 8
    elif case == 'fsdp2_adamw_microbatch':
        learn = learner('adamw', bs=2*MICRO_BS, cbs=[MicroBatching(8, verbose=False), GradientClip(MAX_NORM)])
        with learn.sharded_ctx(): fit(learn, 2)
    # lr_find, then SaveModelCallback keeps the best epoch (with the optimizer), and loads it at the end
    elif case == 'save_load':
        learn = learner('adam', cbs=[GradientAccumulation(ACCUM_BS)])
        learn.path = Path(out)/'save_load'
        start = snapshot(learn)['params']
        with learn.sharded_ctx():
            a,b = quiet(learn)
            with a, b: res['lr_find'] = learn.lr_find(num_it=20, show_plot=False).valley
            res['after_lr_find'] = snapshot(learn)['params']
            res['opt_after_lr_find'] = opt_state(learn)
            fit(learn, 3, cbs=SaveModelCallback(fname='best', with_opt=True))
            res['valid_losses'] = [float(v[1]) for v in learn.recorder.values]
            # runs the fit's events, with no optimizer: sharded, shared out, gathered
            res['validate'] = float(learn.validate()[0])
        res['start'] = start
    elif case == 'ctx_starts_group': # `sharded_ctx` joins the process group itself (gloo on the CPU), and leaves it
        learn = learner('adam', cbs=[GradientAccumulation(ACCUM_BS)])
        with learn.sharded_ctx(cpu=True, timeout=timedelta(seconds=PG_TIMEOUT)):
            res['backend'] = dist.get_backend()
            fit(learn, 1)
        res['group_after'] = dist.is_initialized()
    elif case == 'user_fsdp2_ctx':  # sharded before the Learner; the context shares the data out and keeps the shards
        learn = learner(
            'adam',
            cbs=[GradientAccumulation(ACCUM_BS), GradientClip(MAX_NORM)],
            model=fully_shard_user(digits_mlp(seed=0)),
        )
        learn.path = Path(out)/'user'
        with learn.sharded_ctx():
            learn.save('start') # a plain checkpoint of the sharded start
            fit(learn, 2)
            res['sharded_after'] = is_sharded(learn.model)
            learn.save('end')
            end = [p.full_tensor().clone() for p in learn.model.parameters()]
            learn.load('start') # back to the start, into the shards
            res['reloaded_start'] = [p.full_tensor().clone() for p in learn.model.parameters()]
            learn.load('end')
            res['reloaded_end'] = [p.full_tensor().clone() for p in learn.model.parameters()]
        res.update(params=end, batches=learn.seen.batches)
        return torch.save(res, os.path.join(out, f'{case}-rank{rank}.pt')) # the model stays sharded: no snapshot
    elif case == 'user_fsdp1_by_hand':  # FSDP1 before the Learner, per-process loaders split by hand, no context
        learn = learner(
            'sgd',
            cbs=[GradientAccumulation(ACCUM_BS), GradientClip(MAX_NORM)],
            model=fsdp1_user(digits_mlp(seed=0)),
            dls=half_dls(rank),
        )
        fit(learn, 2)
        learn.path = Path(out)/'user1'
        learn.save('end')
        return torch.save(dict(batches=learn.seen.batches), os.path.join(out, f'{case}-rank{rank}.pt'))
    # tied weights, the default policy: the two holders join the root's block
    elif case in ('tied_fsdp2', 'tied_fsdp1'):
        learn = learner(
            'adam' if case == 'tied_fsdp2' else 'sgd', cbs=[GradientAccumulation(ACCUM_BS)], model=tied_mlp()
        )
        with learn.sharded_ctx(engine=case[-5:]): fit(learn, 2)
        res['still_tied'] = learn.model[0].weight is learn.model[2].weight
    # a policy that shards each Linear apart splits the tied pair: refused before anything changes
    elif case == 'tied_refused':
        learn = learner('sgd', cbs=[GradientAccumulation(ACCUM_BS)], model=tied_mlp())
        model,before = learn.model,snapshot(learn)['params']
        try:
            with learn.sharded_ctx(policy=nn.Linear): fit(learn, 1)
        except ValueError as e: res['error'] = str(e)
        res['untouched'] = learn.model is model and all(
            torch.equal(p, q) for p, q in zip(before, snapshot(learn)['params'])
        )
        res['group_after'] = dist.is_initialized() # an error every process raised: the group stays (failfast)
        return torch.save(res, os.path.join(out, f'{case}-rank{rank}.pt'))
    elif case.startswith('before_'): return run_before(case, out, rank)
    else: raise ValueError(case)
    res.update(snapshot(learn), batches=learn.seen.batches, opt=opt_state(learn))
    torch.save(res, os.path.join(out, f'{case}-rank{rank}.pt'))

# --- what fastai does on a sharded model without this library's `sharded` module (run with FXA_BEFORE=1)
class ShardInBeforeFit(Callback):
    ("A `prepare` that shards the model in `before_fit`, as `DistributedTrainer` wraps it in DDP, and unwraps it as "
     "that does")

    order = 11
    def before_fit(self): fully_shard_user(self.learn.model)
    def after_fit(self): self.learn.model = self.learn.model.module

def run_before(case, out, rank):
    res = {}
    def attempt(f):
        from fastxtend_accum.failfast import keep_group
        try: # fastai's errors here are expected on both processes, maybe not at once: the group stays for the next case
            with keep_group(): f()
            return None
        # fastai puts the cause on a line of its own
        except Exception as e: return ' '.join(f'{type(e).__name__}: {e}'.split())[:400]
    if case == 'before_distrib_ctx': # fastai's DDP path on a model the user sharded
        learn = learner('adam', cbs=[GradientAccumulation(ACCUM_BS)], model=fully_shard_user(digits_mlp(seed=0)))
        def f():
            with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar(): learn.fit(1)
        res['error'] = attempt(f)
    elif case == 'before_prepare': # sharding inside the fit: the optimizer holds the parameters fully_shard replaced
        learn = learner('adam', cbs=[GradientAccumulation(ACCUM_BS), ShardInBeforeFit()], dls=half_dls(rank))
        before = [p.detach().clone() for p in learn.model.parameters()]
        def f():
            with learn.no_logging(), learn.no_bar(): learn.fit(1)
        res['error'] = attempt(f)
        res['moved'] = max((p.full_tensor() - q).abs().max().item() for p,q in zip(learn.model.parameters(), before))
    elif case == 'before_fastai_opt_fsdp1':
        learn = learner(
            'sgd', cbs=[GradientAccumulation(ACCUM_BS)], model=fsdp1_user(digits_mlp(seed=0)), dls=half_dls(rank)
        )

        def f():
            with learn.no_logging(), learn.no_bar(): learn.fit(1)
        res['error'] = attempt(f)
    elif case == 'before_clip_fsdp1': # PyTorch's AdamW (fastai's optimizers crash on FSDP1), fastai's GradientClip
        norms = Norms()
        learn = learner(
            'adamw',
            cbs=[GradientAccumulation(ACCUM_BS), norms, GradientClip(MAX_NORM)],
            model=fsdp1_user(digits_mlp(seed=0)),
            dls=half_dls(rank),
        )
        with learn.no_logging(), learn.no_bar(): learn.fit(1)
        res['norms'] = (norms.local, norms.whole)
    else: raise ValueError(case)
    torch.save(res, os.path.join(out, f'{case}-rank{rank}.pt'))

CASES = [
    'fsdp2_adam',
    'fsdp1_sgd',
    'fsdp1_shardclip',
    'fsdp1_adam',
    'fsdp2_adamw_microbatch',
    'save_load',
    'user_fsdp2_ctx',
    'user_fsdp1_by_hand',
]
# 'ctx_starts_group' runs in a launch of its own: a default group started again after one ended reuses its name, and so
# its keys in torchrun's store, and a process may read the ended group's address (gloo then times out connecting)
TIED_CASES = ['tied_fsdp2', 'tied_fsdp1', 'tied_refused'] # tied weights, in a launch of their own
BEFORE_CASES = ['before_distrib_ctx', 'before_prepare', 'before_fastai_opt_fsdp1', 'before_clip_fsdp1']

def main(out, cases):
    import faulthandler, signal
    faulthandler.register(signal.SIGTERM, all_threads=True) # a process torchrun ends shows where it waited
    torch.set_num_threads(1)
    fastai_distributed() # DistributedDL broadcasts the epoch's order on the CPU under gloo
    rank = int(os.environ['RANK'])
    if cases != ['ctx_starts_group']: dist.init_process_group('gloo', timeout=timedelta(seconds=PG_TIMEOUT))
    for case in cases:
        run_case(case, out, rank)
        if rank == 0: print(f'{case}: done', flush=True)
    if dist.is_initialized(): dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2].split(',') if len(sys.argv) > 2 else (BEFORE_CASES if BEFORE else CASES))
    from ddp_worker import exit_worker; exit_worker() # no teardown for gloo's threads to abort
