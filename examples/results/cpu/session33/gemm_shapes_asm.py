# generate asm kernels: MR x NV, B fused into FMAs (mem operand) or loaded once
import sys
def kern(name, MR, NV, fused):
    lines = ["1:"]
    acc = lambda r, v: f"%%ymm{r*NV+v}"
    nacc = MR*NV
    breg = [f"%%ymm{nacc+v}" for v in range(NV)] if not fused else None
    areg = f"%%ymm15"
    if not fused:
        for v in range(NV): lines.append(f"vmovaps {32*v}(%0),{breg[v]}")
    for r in range(MR):
        lines.append(f"vbroadcastss {256*r}(%1),{areg}")
        for v in range(NV):
            src = f"{32*v}(%0)" if fused else breg[v]
            lines.append(f"vfmadd231ps {src},{areg},{acc(r,v)}")
    lines += ["add $256,%0", "add $4,%1", "dec %2", "jnz 1b"]
    body = "\\n".join(lines)
    clob = ",".join(f'"xmm{i}"' for i in range(16))
    return f'''__attribute__((noinline)) void {name}(long n) {{ for (long rep = 0; rep < n; ++rep) {{ const float* bp = b; const float* ap = a; long k = 64;
  asm volatile("{body}" : "+r"(bp), "+r"(ap), "+r"(k) :: "memory",{clob}); }} }}
'''
cases = [("k6x2", 6, 2, False), ("k6x2f", 6, 2, True), ("k4x3", 4, 3, False), ("k4x3f", 4, 3, True), ("k3x4f", 3, 4, True), ("k2x6f", 2, 6, True), ("k7x2f", 7, 2, True), ("k5x2", 5, 2, False)]
src = ['#include <chrono>\n#include <cstdio>\nstatic double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }\nalignas(64) static float b[64 * 64 + 64], a[8*64+64];']
for c in cases: src.append(kern(*c))
src.append("int main() { for (auto& x : b) x = 1e-9f; for (auto& x : a) x = 1e-9f; const long n = 400000;")
for name, MR, NV, f in cases:
    src.append(f'{{ {name}(100); double t = now(); {name}(n); t = now() - t; printf("%-8s %7.1f GFLOP/s\\n", "{name}", 2.0*{MR*NV}*8*64*n/t/1e9); }}')
src.append("}")
open("micro8.cc", "w").write("\n".join(src))
