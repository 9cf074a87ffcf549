# Prints the rows of benchmark tables side by side: GFLOP/s, flash/torch, % of the FMA peak.
import sys
def rows(path):
    out = {}
    for l in open(path):
        c = [x.strip() for x in l.split('|')]
        if len(c) > 10 and c[1].isdigit():
            out[(c[1], c[2], c[3], c[4])] = (float(c[6]), float(c[8]), c[10], c[-2])
    return out
if __name__ == "__main__":
    files = sys.argv[1:]
    data = [rows(f) for f in files]
    print("seq hd causal pass | " + " | ".join(f.split('/')[-2].replace('out_','') for f in files))
    for k in data[0]:
        print(" ".join(k), "|", " | ".join(f"{d[k][0]:6.1f} {d[k][2]:>6} {d[k][3]:>4}" for d in data))
