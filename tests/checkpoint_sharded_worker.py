"""One process of a sharded run (gloo, CPU, float64) that saves or loads a `torch.distributed.checkpoint`, started by
`test_checkpoint_sharded.py` as
`python -m torch.distributed.run --nproc_per_node=N tests/checkpoint_sharded_worker.py OUT CASES [SRC]`.

`cut` fits the digits MLP in `learn.sharded_ctx()` (FSDP2, fastai's Adam, `GradientAccumulation`), saves with
`save_sharded` after the first epoch's optimizer steps and cancels the fit; `whole` is the same fit, not cancelled;
`resume` is a new process group that builds the same Learner, loads the checkpoint with `load_sharded` at the start of
its fit and trains the second epoch. Each writes `OUT/<case>-rank<r>.pt`: the state gathered whole at the save or load,
and at the end."""
import os, sys
from datetime import timedelta
from copy import deepcopy
from functools import partial
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ddp_worker import fastai_distributed, exit_worker
from sharded_worker import fsdp1_user, default_dls, opt_state, snapshot, PG_TIMEOUT, MICRO_BS, ACCUM_BS
from fastxtend_accum.sharded import full_model_state, full_opt_state, layout_of
from fastxtend_accum.checkpoint_sharded import save_sharded, load_sharded
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss

OPTS = dict(adam=(Adam, 1e-2), adamw=(partial(OptimWrapper, opt=torch.optim.AdamW), 1e-2))

def learner(opt='adam'):
    of,lr = OPTS[opt]
    return Learner(default_dls(MICRO_BS), digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(), opt_func=of, lr=lr,
                   cbs=[Float64SmoothLoss(), GradientAccumulation(ACCUM_BS)])

def shuffle_rng(learn):
    dl = learn.dls.train
    return getattr(dl, 'dl', dl).rng # fastai's DistributedDL wraps the loader; rank 0's order is every process's

def gathered(learn):
    """The sharded model's and optimizer's state, whole, on every process (collectives), copied: on one process
    `full_tensor()` gives the live tensor itself"""
    return deepcopy(dict(model=full_model_state(learn.model), opt=full_opt_state(learn.opt, layout_of(learn.model))))

class SaveAfterEpoch(Callback):
    "After the first epoch: `save_sharded`, the state gathered whole, the loader's random state; cancel if `cancel`"
    order = 100
    def __init__(self, folder, cancel, rec): self.folder,self.cancel,self.rec = folder,cancel,rec
    def after_epoch(self):
        if self.epoch: return
        save_sharded(self.folder, self.model, self.opt)
        self.rec.update(saved=gathered(self.learn), shuffle=shuffle_rng(self.learn).getstate())
        if self.cancel: raise CancelFitException()

class LoadAtStart(Callback):
    "At the fit's start, once the model is sharded (`ShardedTrainer`'s order is 11): `load_sharded`, the loader's state"
    order = 12
    def __init__(self, folder, shuffle, rec): self.folder,self.shuffle,self.rec = folder,shuffle,rec
    def before_fit(self):
        self.rec['loaded_from'] = load_sharded(self.folder, self.model, self.opt)
        shuffle_rng(self.learn).setstate(self.shuffle)
        self.rec['loaded'] = gathered(self.learn)

def run_case(case, out, src, rank):
    res = {}
    quiet = lambda l: (l.no_logging(), l.no_bar())
    opt = 'adamw' if case.endswith('_adamw') else 'adam'
    base = case.removesuffix('_adamw')
    learn = learner(opt)
    if base in ('cut', 'whole'):
        cb = SaveAfterEpoch(Path(out)/f'ck_{case}', base == 'cut', res)
        with learn.sharded_ctx():
            a,b = quiet(learn)
            with a, b: learn.fit(2, cbs=cb)
        if rank == 0: torch.save(res['shuffle'], Path(out)/f'ck_{case}'/'shuffle.pt') # the test's own: the loader's
    elif base in ('resume', 'fresh'):
        src = Path(src)/f"ck_cut{case.removeprefix(base)}" # the `cut` case's checkpoint of the launch in `src`
        shuffle = torch.load(Path(src)/'shuffle.pt', weights_only=False)
        cbs = [LoadAtStart(Path(src), shuffle, res)] if base == 'resume' else []
        if base == 'fresh': shuffle_rng(learn).setstate(shuffle)
        with learn.sharded_ctx():
            a,b = quiet(learn)
            with a, b: learn.fit(1, cbs=cbs)
    elif base == 'fsdp1': # refused before any collective, outside a fit (a fit's error would go through failfast)
        model = fsdp1_user(digits_mlp(seed=0))
        opt = Adam(list(model.parameters()), lr=1e-3)
        for f in (save_sharded, load_sharded):
            try: f(Path(out)/'ck_fsdp1', model, opt)
            except NotImplementedError as e: res[f.__name__] = str(e)
        return torch.save(res, Path(out)/f'{case}-rank{rank}.pt')
    elif base == 'mismatch': # another model (a hidden layer of 16), sharded by hand: refused on every process
        from torch.distributed.fsdp import fully_shard
        model = digits_mlp(16, seed=0)
        for m in model:
            if isinstance(m, nn.Linear): fully_shard(m)
        fully_shard(model)
        try: load_sharded(Path(src)/'ck_cut', model, Adam(list(model.parameters()), lr=1e-3))
        except ValueError as e: res['error'] = str(e)
        return torch.save(res, Path(out)/f'{case}-rank{rank}.pt')
    else: raise ValueError(case)
    res.update(snapshot(learn), opt=opt_state(learn), world=dist.get_world_size())
    torch.save(res, Path(out)/f'{case}-rank{rank}.pt')

def main(out, cases, src):
    import faulthandler, signal
    faulthandler.register(signal.SIGTERM, all_threads=True)
    torch.set_num_threads(1)
    fastai_distributed()
    rank = int(os.environ['RANK'])
    dist.init_process_group('gloo', timeout=timedelta(seconds=PG_TIMEOUT))
    for case in cases:
        run_case(case, out, src, rank)
        if rank == 0: print(f'{case}: done', flush=True)
    dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2].split(','), sys.argv[3] if len(sys.argv) > 3 else None)
    exit_worker()
