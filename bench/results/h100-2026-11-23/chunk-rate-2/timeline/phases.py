import sys
# --w3-gating: traces of 2026-11-24 on (../../../h100-2026-11-24/), where event 10 marks warp 3's
# end of gating; before, it marked the end of its merge pair.
w3_gating = '--w3-gating' in sys.argv
names={0:'P tma issue',1:'P gates written',2:'P in_full seen(q)',3:'P norms q done',28:'P norms k done',4:'L start',5:'L grams done',6:'L local_empty ok',29:'L gating done',7:'L w0 diag inv done',8:'L w3 diag inv done',9:'L w3 after bar1',10:('L w3 gating done' if w3_gating else 'L w3 merge pair'),11:'L w0 factors+T0',12:'L w3 after bar2',13:'L w3 halves_x',14:'L w3 after bar3',15:'L w3 halves_t',16:'L w3 T stored',17:'L w0 local_full',18:'L w3 local_full',19:'L w0 after end bar',20:'S in_full ok',21:'S local_full ok',26:'S1 local_full ok',22:'S QK done',23:'S Vn done',24:'S upd done',25:'S o stored',27:'S1 o stored'}
for f in [a for a in sys.argv[1:] if a != '--w3-gating']:
    rows=[list(map(int,l.split())) for l in open(f)]
    ev=lambda r,e: r[1+e]
    print(f)
    # period
    ps=[rows[i+1][1+4]-rows[i][1+4] for i in range(len(rows)-1)]
    print(' period(L start)', sum(ps)/len(ps))
    ps=[rows[i+1][1+25]-rows[i][1+25] for i in range(len(rows)-1)]
    print(' period(S end)', sum(ps)/len(ps))
    # average offsets relative to L start of same chunk
    order=[0,1,2,3,28,4,5,6,29,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,26,22,23,24,25,27]
    for e in order:
        vals=[r[1+e]-r[1+4] for r in rows[2:14]]
        print('  %-22s %7.0f' % (names[e], sum(vals)/len(vals)))
