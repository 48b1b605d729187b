"""A small char-level language model on real English text (CPython's `pydoc_data.topics`), in float64, with padded
micro-batches: shared by `test_tokens.py`, the distributed worker and `bench/distributed.py`"""
import torch, torch.nn as nn, torch.nn.functional as F
from fastai.basics import Learner, DataLoaders, SGD
from fastai.data.load import DataLoader as FastaiDataLoader
from fastxtend_accum.test_utils import Float64SmoothLoss

PAD,IGNORE = 0,-100
VOCAB = 97 # 0: padding, 1-95: printable ASCII, 96: anything else

def encode(s:str)->list[int]: return [ord(c)-31 if 32 <= ord(c) < 127 else 96 for c in s]

def text_lines(n:int=300, min_len:int=8, max_len:int=48)->list[str]:
    "The first `n` lines of Python's help topics with at least `min_len` characters, cut at `max_len`: lengths vary"
    from pydoc_data.topics import topics
    lines = (l.strip() for k in sorted(topics) for l in topics[k].splitlines())
    return [l[:max_len] for l,_ in zip((l for l in lines if len(l) >= min_len), range(n))]

def text_samples(n:int=300, **kwargs)->list[tuple]:
    "Next-character samples `(x, y)`: `x` a line but its last character, `y` the line but its first"
    return [(torch.tensor(ids[:-1]), torch.tensor(ids[1:])) for ids in map(encode, text_lines(n, **kwargs))]

def pad_batch(samples:list[tuple])->tuple:
    "Pad a micro-batch to its longest line: inputs with `PAD`, targets with `IGNORE`"
    xs,ys = zip(*samples)
    L = max(len(x) for x in xs)
    x = torch.full((len(xs), L), PAD, dtype=torch.long)
    y = torch.full((len(xs), L), IGNORE, dtype=torch.long)
    for i,(a,b) in enumerate(zip(xs, ys)): x[i,:len(a)],y[i,:len(b)] = a,b
    return x,y

def text_dl(samples, bs:int, drop_last:bool=False)->FastaiDataLoader:
    "A fastai loader over `samples` in order, padding each micro-batch"
    return FastaiDataLoader(samples, bs=bs, shuffle=False, drop_last=drop_last, create_batch=pad_batch, device='cpu')

def text_dls(bs:int, n:int=300, n_valid:int=32, samples=None)->DataLoaders:
    "Training loader of micro-batches of `bs` over `samples` (or the first `n` lines), validation over the next `n_valid`"
    samples = text_samples(n) if samples is None else samples
    valid = text_samples(len(samples)+n_valid)[len(samples):]
    return DataLoaders(text_dl(samples, bs), text_dl(valid, 64), device='cpu')

class CharGRU(nn.Module):
    "Embedding, GRU, linear head: left to right, so trailing padding never changes what comes before it"
    def __init__(self, n_emb:int=16, n_hidden:int=32, seed:int=0, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.emb,self.rnn,self.head = nn.Embedding(VOCAB, n_emb),nn.GRU(n_emb, n_hidden, batch_first=True),nn.Linear(n_hidden, VOCAB)
        self.to(dtype)
    def forward(self, x): return self.head(self.rnn(self.emb(x))[0])

def token_loss(pred, y):
    "Cross-entropy averaged over the micro-batch's targets that are not padding: a mean over tokens"
    return F.cross_entropy(pred.flatten(0, 1), y.flatten(), ignore_index=IGNORE)

def text_learner(bs:int, n:int=300, seed:int=0, lr:float=0.5, samples=None, cbs=None, **kwargs)->Learner:
    "A float64 char-level `Learner` whose start is fixed by `seed`"
    return Learner(text_dls(bs, n, samples=samples), CharGRU(seed=seed), loss_func=token_loss, opt_func=SGD, lr=lr,
                   cbs=[Float64SmoothLoss()] + list(cbs or []), **kwargs)
