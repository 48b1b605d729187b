"""Where `make env` installs PyTorch from: prints the pip options for it (nothing: the indexes pip is configured with).

`TORCH_INDEX` given (`make env TORCH_INDEX=https://download.pytorch.org/whl/cu126`): that index, as named. Otherwise
PyTorch's CPU index where it answers within 3 seconds (one request, no retries: an unreachable index costs no more),
else pip's own configuration (PyPI, and whatever a machine adds: here a folder of CPU wheels). A line on stderr says
which."""

from __future__ import annotations
import os, sys, threading, urllib.request

CPU_INDEX = 'https://download.pytorch.org/whl/cpu'

def answers(url:str, timeout:float=3.)->str|None:
    ("None when `url` answers (HTTP 200) within `timeout` seconds, else why not (a thread: the socket timeout leaves "
     "DNS out)")
    res = ['no answer within %g s' % timeout]
    def get():
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                res[0] = None if r.status == 200 else f'HTTP {r.status}'
        except Exception as e:
            res[0] = f'{type(e).__name__}: {getattr(e, "reason", e)}'
    t = threading.Thread(target=get, daemon=True); t.start(); t.join(timeout)
    return res[0]

def main(named:str='')->str:
    if named:
        msg, opts = f'torch from TORCH_INDEX={named}', f'--index-url {named}'
    elif (why := answers(f'{CPU_INDEX}/torch/')) is None:
        msg, opts = f"torch from PyTorch's CPU index ({CPU_INDEX})", f'--index-url {CPU_INDEX}'
    else: msg,opts = f"PyTorch's CPU index did not answer ({why}): torch from the indexes pip is configured with",''
    print(msg, file=sys.stderr)
    return opts

if __name__ == '__main__': print(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get('TORCH_INDEX', '')))
