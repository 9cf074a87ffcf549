# The session-24 full table in compact form (full_table.md): call 5's cases, call 4's where call 5 was cut.
import json
def load(p):
    out={}
    for m in json.load(open(p))['measurements']:
        if m['status']!='ok': continue
        out[(m['head_dim'],m['seq'],m['causal'],m['peer'],m['pass'])]=m
    return out
import os
os.chdir(os.path.dirname(os.path.abspath(__file__)))
c5=load('call5/full.json'); c4=load('call4/full.json')
def tf(m): return m['gflops']/1000
rows=[]
print("| hd | seq | causal | fwd: jax_flash / cuDNN / tokamax | fwd / faster peer | bwd / cuDNN | fwd+bwd: jax_flash / cuDNN / tokamax | fwd+bwd / cuDNN | fwd+bwd temp MiB: jax_flash (cuDNN, tokamax) |")
print("|---|---|---|---|---|---|---|---|---|")
for hd in (64,128,256):
  for seq in (1024,2048,4096,8192,16384):
    for causal in (False,True):
      src=c5; mark=''
      if (hd,seq,causal,'jax_flash','fwd+bwd') not in c5: src=c4; mark=' (call 4)'
      g=lambda peer,ps: src.get((hd,seq,causal,peer,ps))
      f=[g(p,'fwd') for p in ('jax_flash','cudnn','tokamax')]
      fb=[g(p,'fwd+bwd') for p in ('jax_flash','cudnn','tokamax')]
      b=[g(p,'bwd') for p in ('jax_flash','cudnn')]
      def s(m): return f"{tf(m):.1f}" if m else "-"
      fastest=max(tf(m) for m in f[1:] if m)
      bwd_ratio = f"{tf(b[0])/tf(b[1]):.2f}x" if b[0] and b[1] else "-"
      temp=lambda m: f"{m['temp_bytes']/2**20:.0f}" if m else '-'
      print(f"| {hd} | {seq}{mark} | {'Y' if causal else 'N'} | {s(f[0])} / {s(f[1])} / {s(f[2])} | {tf(f[0])/fastest:.2f}x | {bwd_ratio} | {s(fb[0])} / {s(fb[1])} / {s(fb[2])} | {tf(fb[0])/tf(fb[1]):.2f}x | {temp(fb[0])} ({temp(fb[1])}, {temp(fb[2])}) |")
