------------------------------- MODULE Octo -------------------------------
(***************************************************************************)
(* What Octo's worker and host promise, as a state machine TLC checks.     *)
(*                                                                         *)
(* The host records an operation in its ledger (durable) and sends a       *)
(* request; the worker admits it in its journal (durable) before it acks   *)
(* the delivery and calls the adapter; the observation and the reply are  *)
(* committed together (the reply sits in the outbox) before the reply is   *)
(* published; the host applies a reply, persists its ledger, and only then *)
(* acks it. After success the host may record one compensation, send it,  *)
(* and the worker runs the inverse effect once. Every step may be cut by a *)
(* crash of the worker or the host; a delivery that was not acked comes    *)
(* back; the broker may deliver a request again, lose a reply, or deliver  *)
(* in any order. A key that failed (no effect) may be retried: the host    *)
(* records the step's next attempt under a new key (RetryKey) and sends it *)
(* like any other. Two workers share one journal (failover): each start    *)
(* reserves a fresh fence, and a commit under an older fence is refused    *)
(* (the worker is superseded and stops). An operator may decide a stuck    *)
(* key. The adapter keeps its own record per key (its idempotency key), so *)
(* a lookup (reconciliation) tells whether the effect happened and a late  *)
(* call after a lookup said "not performed" does nothing.                  *)
(*                                                                         *)
(* The constant Bug selects a deliberately broken variant (a mutant of the *)
(* code, in the model's terms); "none" is Octo as built. docs/model.md     *)
(* says which kill point of the crash matrix each Crash* action stands     *)
(* for; tests/model/test_model.py checks that table and that TLC takes     *)
(* every one of those actions.                                             *)
(*                                                                         *)
(* Not modelled: concurrency inside one worker (the key lock serialises a  *)
(* key's handlings, so one handling at a time per worker), budgets,        *)
(* session windows (a duplicate is told by the journal), payloads and      *)
(* tampering (the frame layer's own tests), liveness.                      *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    FirstKeys,             \* the operation keys of one run, as first recorded
    RetryKey,              \* the key of the one retry of a failed key ("none": no retry)
    Workers,               \* workers sharing one journal (owner and standby)
    MaxRequests,           \* requests the host may publish
    MaxFence,              \* fences the journal may hand out (worker starts)
    MaxWorkerCrashes,
    MaxHostCrashes,
    MaxDuplicates,         \* requests the broker delivers again after their ack
    MaxLostReplies,        \* replies that never reach the host
    MaxOperatorDecisions,  \* octo-host resolve on a stuck key
    Bug                    \* "none" or the name of a broken variant

NoOp == "none"
\* Every key: the run's, and the retry's (a step's next attempt, under a new key).
Keys == IF RetryKey = NoOp THEN FirstKeys ELSE FirstKeys \cup {RetryKey}
Terminal == {"succeeded", "failed"}
Idle == [step |-> "idle"]

VARIABLES
    journal,     \* durable worker journal (shared): key -> [op, cmp]
    fence,       \* the journal's current fence
    lease,       \* worker -> the fence it reserved at its start
    wstate,      \* worker -> "down" | "up" | "superseded"
    wpc,         \* worker -> the handling in progress (Idle or [step, msg, res])
    outbox,      \* durable replies not yet released
    arec,        \* key -> the adapter's record of the effect: none|done|failed|refused
    crec,        \* key -> the same for the inverse effect
    effects,     \* key -> effects performed in the world
    ceffects,    \* key -> inverse effects performed
    calls,       \* key -> adapter dispatch calls
    ccalls,      \* key -> adapter compensate calls
    reqQ,        \* requests in the worker's queue (not acked: delivered again)
    sent,        \* every request published (a duplicate is one of these)
    repQ,        \* replies in the host's reply queue (not acked)
    ledger,      \* durable host ledger: key -> [op, cmp, operator]
    unsent,      \* host memory: keys recorded and not sent since
    cunsent,     \* host memory: compensations recorded and not sent since
    hpc,         \* host memory: a reply applied, not yet durable
    hepoch,      \* host incarnation (a reply to an earlier one is dead-lettered)
    earlyAcks,   \* history: replies the host acked before their ledger change was durable
    fencedActs,  \* history: commits or publishes of a worker without the current fence
    nextId,      \* requests published so far
    budget       \* faults used so far

vars == <<journal, fence, lease, wstate, wpc, outbox, arec, crec, effects, ceffects,
          calls, ccalls, reqQ, sent, repQ, ledger, unsent, cunsent, hpc, hepoch,
          earlyAcks, fencedActs, nextId, budget>>

worldVars == <<arec, crec, effects, ceffects, calls, ccalls>>
hostVars == <<ledger, unsent, cunsent, hpc, hepoch, earlyAcks>>

Init ==
    /\ journal = [k \in Keys |-> [op |-> NoOp, cmp |-> NoOp]]
    /\ fence = 0
    /\ lease = [w \in Workers |-> 0]
    /\ wstate = [w \in Workers |-> "down"]
    /\ wpc = [w \in Workers |-> Idle]
    /\ outbox = {}
    /\ arec = [k \in Keys |-> NoOp]
    /\ crec = [k \in Keys |-> NoOp]
    /\ effects = [k \in Keys |-> 0]
    /\ ceffects = [k \in Keys |-> 0]
    /\ calls = [k \in Keys |-> 0]
    /\ ccalls = [k \in Keys |-> 0]
    /\ reqQ = {}
    /\ sent = {}
    /\ repQ = {}
    /\ ledger = [k \in Keys |-> [op |-> NoOp, cmp |-> NoOp, operator |-> FALSE]]
    /\ unsent = {}
    /\ cunsent = {}
    /\ hpc = Idle
    /\ hepoch = 0
    /\ earlyAcks = 0
    /\ fencedActs = 0
    /\ nextId = 0
    /\ budget = [wcrash |-> 0, hcrash |-> 0, dup |-> 0, lost |-> 0, operator |-> 0]

\* A request is its kind, key and the host incarnation that sent it (two equal
\* requests in the queue are one: the worker answers both alike).
Reply(m, v) == [kind |-> m.kind, key |-> m.key, val |-> v, hep |-> m.hep]

(***************************************************************************)
(* Worker                                                                  *)
(***************************************************************************)

Owns(w) == lease[w] = fence

\* A commit under an older fence is refused (FencingTokenRejected): the
\* session marks itself superseded, the delivery goes back unacked, nothing is
\* published. Bug "superseded_refuses": it publishes a refusal all the same.
FenceRejected(w, m) ==
    /\ ~Owns(w)
    /\ wstate' = [wstate EXCEPT ![w] = "superseded"]
    /\ wpc' = [wpc EXCEPT ![w] = Idle]
    /\ IF Bug = "superseded_refuses" /\ wpc[w].step # "replied"
         THEN /\ repQ' = repQ \cup {Reply(m, "poisoned")}
              /\ fencedActs' = fencedActs + 1
         ELSE UNCHANGED <<repQ, fencedActs>>
    /\ UNCHANGED <<journal, fence, lease, outbox, worldVars, reqQ, sent, hostVars,
                   nextId, budget>>

\* Bug "no_fence": the store takes a commit whatever the fence.
MayCommit(w) == Owns(w) \/ Bug = "no_fence"
CommitNoted(w) == fencedActs' = fencedActs + (IF Owns(w) THEN 0 ELSE 1)

WStart(w) ==
    /\ wstate[w] = "down"
    /\ fence < MaxFence
    /\ fence' = fence + 1
    /\ lease' = [lease EXCEPT ![w] = fence + 1]
    /\ wstate' = [wstate EXCEPT ![w] = "up"]
    \* The outbox is published again, oldest first (identical bytes).
    /\ repQ' = repQ \cup outbox
    /\ UNCHANGED <<journal, wpc, outbox, worldVars, reqQ, sent, hostVars, fencedActs,
                   nextId, budget>>

\* A superseded worker stops; a supervisor may start it again later.
WStop(w) ==
    /\ wstate[w] = "superseded"
    /\ wstate' = [wstate EXCEPT ![w] = "down"]
    /\ UNCHANGED <<journal, fence, lease, wpc, outbox, worldVars, reqQ, sent, repQ,
                   hostVars, fencedActs, nextId, budget>>

\* The first commit of a handling that answers at once (from the journal, a
\* refusal, an unknown key): the reply goes into the outbox with it.
Answer(w, m, v) ==
    \/ /\ MayCommit(w)
       /\ CommitNoted(w)
       /\ outbox' = outbox \cup {Reply(m, v)}
       /\ wpc' = [wpc EXCEPT ![w] = [step |-> "observed", msg |-> m, res |-> v]]
       /\ UNCHANGED <<journal, wstate, arec, crec, repQ>>
    \/ FenceRejected(w, m) /\ UNCHANGED <<arec, crec>>

\* A delivery taken by an idle worker: load the key's row, decide, first commit.
WHandle(w, m) ==
    LET k == m.key IN
    /\ wstate[w] = "up"
    /\ wpc[w] = Idle
    /\ m \in reqQ
    /\ CASE m.kind = "dispatch" ->
              IF journal[k].op = NoOp
              THEN IF Bug = "ack_before_admission"
                   THEN \* acked and sent to the adapter before anything is durable
                        /\ wpc' = [wpc EXCEPT ![w] = [step |-> "acked", msg |-> m, res |-> NoOp]]
                        /\ reqQ' = reqQ \ {m}
                        /\ UNCHANGED <<journal, outbox, wstate, fencedActs, repQ>>
                   ELSE \/ /\ MayCommit(w)
                           /\ CommitNoted(w)
                           /\ journal' = [journal EXCEPT ![k].op = "pending"]
                           /\ wpc' = [wpc EXCEPT ![w] = [step |-> "admitted", msg |-> m,
                                                          res |-> NoOp]]
                           /\ UNCHANGED <<outbox, wstate, reqQ, repQ>>
                        \/ FenceRejected(w, m) /\ UNCHANGED reqQ
              ELSE IF journal[k].op = "pending" /\ Bug = "rerun_pending"
                   THEN \* a redelivered admitted key sent to the adapter again
                        /\ wpc' = [wpc EXCEPT ![w] = [step |-> "acked", msg |-> m, res |-> NoOp]]
                        /\ reqQ' = reqQ \ {m}
                        /\ UNCHANGED <<journal, outbox, wstate, fencedActs, repQ>>
                   ELSE Answer(w, m, journal[k].op) /\ UNCHANGED reqQ
         [] m.kind = "reconcile" ->
              IF journal[k].op = "pending"
              THEN \* the adapter's lookup; nothing is committed before it ends
                   /\ wpc' = [wpc EXCEPT ![w] = [step |-> "looked", msg |-> m,
                                  res |-> IF arec[k] = "done" THEN "succeeded" ELSE "failed"]]
                   /\ UNCHANGED <<journal, outbox, wstate, reqQ, fencedActs, repQ>>
              ELSE Answer(w, m, IF journal[k].op = NoOp THEN "unknown" ELSE journal[k].op)
                   /\ UNCHANGED reqQ
         [] m.kind = "compensate" ->
              IF journal[k].op # "succeeded"
              THEN Answer(w, m, "refused") /\ UNCHANGED reqQ
              ELSE IF journal[k].cmp # NoOp
              THEN Answer(w, m, journal[k].cmp) /\ UNCHANGED reqQ
              ELSE \/ /\ MayCommit(w)
                      /\ CommitNoted(w)
                      /\ journal' = [journal EXCEPT ![k].cmp = "pending"]
                      /\ wpc' = [wpc EXCEPT ![w] = [step |-> "cadmitted", msg |-> m, res |-> NoOp]]
                      /\ UNCHANGED <<outbox, wstate, reqQ, repQ>>
                   \/ FenceRejected(w, m) /\ UNCHANGED reqQ
         [] m.kind = "creconcile" ->
              IF journal[k].cmp = "pending"
              THEN /\ wpc' = [wpc EXCEPT ![w] = [step |-> "clooked", msg |-> m,
                                  res |-> IF crec[k] = "done" THEN "succeeded" ELSE "failed"]]
                   /\ UNCHANGED <<journal, outbox, wstate, reqQ, fencedActs, repQ>>
              ELSE Answer(w, m, IF journal[k].cmp = NoOp THEN "unknown" ELSE journal[k].cmp)
                   /\ UNCHANGED reqQ
    \* A lookup that finds no effect leaves the adapter's record refused: a
    \* call that reaches the adapter later (a superseded worker) does nothing.
    /\ IF m.kind = "reconcile" /\ journal[k].op = "pending" /\ arec[k] = NoOp
         THEN arec' = [arec EXCEPT ![k] = "refused"] ELSE UNCHANGED arec
    /\ IF m.kind = "creconcile" /\ journal[k].cmp = "pending" /\ crec[k] = NoOp
         THEN crec' = [crec EXCEPT ![k] = "refused"] ELSE UNCHANGED crec
    /\ UNCHANGED <<fence, lease, effects, ceffects, calls, ccalls, sent, hostVars,
                   nextId, budget>>

\* The admission is durable: ack the delivery (only then the adapter runs).
WAck(w) ==
    /\ wstate[w] = "up"
    /\ wpc[w].step \in {"admitted", "cadmitted"}
    /\ reqQ' = reqQ \ {wpc[w].msg}
    /\ wpc' = [wpc EXCEPT ![w].step = IF wpc[w].step = "admitted" THEN "acked" ELSE "cacked"]
    /\ UNCHANGED <<journal, fence, lease, wstate, outbox, worldVars, sent, repQ, hostVars,
                   fencedActs, nextId, budget>>

\* The adapter's dispatch, once: it performs the effect or fails; a record
\* left by a lookup (refused) or an earlier call makes it do nothing.
WEffect(w) ==
    LET k == wpc[w].msg.key IN
    /\ wstate[w] = "up"
    /\ wpc[w].step = "acked"
    /\ calls' = [calls EXCEPT ![k] = @ + 1]
    /\ \/ /\ arec[k] = NoOp
          /\ arec' = [arec EXCEPT ![k] = "done"]
          /\ effects' = [effects EXCEPT ![k] = @ + 1]
          /\ wpc' = [wpc EXCEPT ![w].step = "effected", ![w].res = "succeeded"]
       \/ /\ arec[k] = NoOp
          /\ arec' = [arec EXCEPT ![k] = "failed"]
          /\ wpc' = [wpc EXCEPT ![w].step = "effected", ![w].res = "failed"]
          /\ UNCHANGED effects
       \/ /\ arec[k] # NoOp
          /\ wpc' = [wpc EXCEPT ![w].step = "effected",
                                ![w].res = IF arec[k] = "done" THEN "succeeded" ELSE "failed"]
          /\ UNCHANGED <<arec, effects>>
    /\ UNCHANGED <<journal, fence, lease, wstate, outbox, crec, ceffects, ccalls, reqQ, sent,
                   repQ, hostVars, fencedActs, nextId, budget>>

\* The inverse effect, once, as WEffect.
WCEffect(w) ==
    LET k == wpc[w].msg.key IN
    /\ wstate[w] = "up"
    /\ wpc[w].step = "cacked"
    /\ ccalls' = [ccalls EXCEPT ![k] = @ + 1]
    /\ \/ /\ crec[k] = NoOp
          /\ crec' = [crec EXCEPT ![k] = "done"]
          /\ ceffects' = [ceffects EXCEPT ![k] = @ + 1]
          /\ wpc' = [wpc EXCEPT ![w].step = "ceffected", ![w].res = "succeeded"]
       \/ /\ crec[k] = NoOp
          /\ crec' = [crec EXCEPT ![k] = "failed"]
          /\ wpc' = [wpc EXCEPT ![w].step = "ceffected", ![w].res = "failed"]
          /\ UNCHANGED ceffects
       \/ /\ crec[k] # NoOp
          /\ wpc' = [wpc EXCEPT ![w].step = "ceffected",
                                ![w].res = IF crec[k] = "done" THEN "succeeded" ELSE "failed"]
          /\ UNCHANGED <<crec, ceffects>>
    /\ UNCHANGED <<journal, fence, lease, wstate, outbox, arec, effects, calls, reqQ, sent,
                   repQ, hostVars, fencedActs, nextId, budget>>

\* The observation (after the effect or a lookup) committed with its reply in
\* the outbox. A row already terminal keeps its state (the transition table).
WObserve(w) ==
    LET m == wpc[w].msg
        k == m.key
        res == wpc[w].res
        cmp == wpc[w].step \in {"ceffected", "clooked"}
        cur == IF cmp THEN journal[k].cmp ELSE journal[k].op
        new == IF cur \in Terminal THEN cur ELSE res
    IN
    /\ wstate[w] = "up"
    /\ wpc[w].step \in {"effected", "looked", "ceffected", "clooked"}
    /\ \/ /\ MayCommit(w)
          /\ CommitNoted(w)
          /\ journal' = IF cmp THEN [journal EXCEPT ![k].cmp = new]
                               ELSE [journal EXCEPT ![k].op = new]
          /\ outbox' = outbox \cup {Reply(m, new)}
          /\ wpc' = [wpc EXCEPT ![w].step = "observed", ![w].res = new]
          /\ UNCHANGED <<wstate, repQ>>
       \/ FenceRejected(w, m)
    /\ UNCHANGED <<fence, lease, worldVars, reqQ, sent, hostVars, nextId, budget>>

\* The reply published (confirmed by the broker).
WPublish(w) ==
    /\ wstate[w] = "up"
    /\ wpc[w].step = "observed"
    /\ repQ' = repQ \cup {Reply(wpc[w].msg, wpc[w].res)}
    /\ wpc' = [wpc EXCEPT ![w].step = "replied"]
    /\ UNCHANGED <<journal, fence, lease, wstate, outbox, worldVars, reqQ, sent, hostVars,
                   fencedActs, nextId, budget>>

\* Acked if not yet, and the outbox row released in a later commit.
WRelease(w) ==
    LET r == Reply(wpc[w].msg, wpc[w].res) IN
    /\ wstate[w] = "up"
    /\ wpc[w].step = "replied"
    /\ \/ /\ MayCommit(w)
          /\ CommitNoted(w)
          /\ reqQ' = reqQ \ {wpc[w].msg}
          /\ outbox' = outbox \ {r}
          /\ wpc' = [wpc EXCEPT ![w] = Idle]
          /\ UNCHANGED <<wstate, repQ>>
       \/ FenceRejected(w, wpc[w].msg) /\ UNCHANGED <<reqQ>>
    /\ UNCHANGED <<journal, fence, lease, worldVars, sent, hostVars, nextId, budget>>

\* SIGKILL of a worker: its memory is gone; what it did not ack comes back.
WorkerDies(w) ==
    /\ wstate[w] = "up"
    /\ budget.wcrash < MaxWorkerCrashes
    /\ budget' = [budget EXCEPT !.wcrash = @ + 1]
    /\ wstate' = [wstate EXCEPT ![w] = "down"]
    /\ wpc' = [wpc EXCEPT ![w] = Idle]
    /\ UNCHANGED <<journal, fence, lease, outbox, worldVars, reqQ, sent, repQ, hostVars,
                   fencedActs, nextId>>

\* One action per kill point of the crash matrix (docs/model.md).
CrashAfterAdmissionCommit(w) == wpc[w].step = "admitted" /\ WorkerDies(w)
CrashAfterAck(w) == wpc[w].step \in {"acked", "cacked"} /\ WorkerDies(w)
CrashAfterEffect(w) == wpc[w].step = "effected" /\ WorkerDies(w)
CrashBeforeReply(w) == wpc[w].step = "observed" /\ WorkerDies(w)
CrashAfterReply(w) == wpc[w].step = "replied" /\ WorkerDies(w)
CrashAfterCompensationAdmissionCommit(w) == wpc[w].step = "cadmitted" /\ WorkerDies(w)
CrashAfterCompensationEffect(w) == wpc[w].step = "ceffected" /\ WorkerDies(w)
\* Any other moment: idle, inside a lookup.
WorkerCrashElsewhere(w) == wpc[w].step \in {"idle", "looked", "clooked"} /\ WorkerDies(w)

(***************************************************************************)
(* Host                                                                    *)
(***************************************************************************)

Publish(kind, k) ==
    LET m == [kind |-> kind, key |-> k, hep |-> hepoch] IN
    /\ nextId < MaxRequests
    /\ nextId' = nextId + 1
    /\ reqQ' = reqQ \cup {m}
    \* (kept only where the broker may deliver a request again)
    /\ sent' = IF MaxDuplicates > 0 THEN sent \cup {m} ELSE sent

HostIdle == hpc = Idle

HRecord(k) ==
    /\ HostIdle
    /\ k \in FirstKeys
    /\ ledger[k].op = NoOp
    /\ ledger' = [ledger EXCEPT ![k].op = "pending"]
    /\ unsent' = unsent \cup {k}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent, repQ,
                   cunsent, hpc, hepoch, earlyAcks, fencedActs, nextId, budget>>

\* A step's retry: once a key failed (no effect), its next attempt is recorded
\* under a new key (durable), then dispatched like any recorded key.
HRecordRetry ==
    /\ HostIdle
    /\ RetryKey # NoOp
    /\ ledger[RetryKey].op = NoOp
    /\ \E k \in FirstKeys : ledger[k].op = "failed"
    /\ ledger' = [ledger EXCEPT ![RetryKey].op = "pending"]
    /\ unsent' = unsent \cup {RetryKey}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent, repQ,
                   cunsent, hpc, hepoch, earlyAcks, fencedActs, nextId, budget>>

\* Only a key recorded (or told unknown by the worker) and not sent since.
HDispatch(k) ==
    /\ HostIdle
    /\ k \in unsent
    /\ ledger[k].op = "pending"
    /\ Publish("dispatch", k)
    /\ unsent' = unsent \ {k}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, repQ, ledger,
                   cunsent, hpc, hepoch, earlyAcks, fencedActs, budget>>

\* A timeout, a lost reply or a restart: never evidence; the key is reconciled.
HReconcile(k) ==
    /\ HostIdle
    /\ k \notin unsent
    /\ ledger[k].op = "pending"
    /\ Publish("reconcile", k)
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, repQ, hostVars,
                   fencedActs, budget>>

HRecordCompensation(k) ==
    /\ HostIdle
    /\ ledger[k].op = "succeeded"
    /\ ledger[k].cmp = NoOp
    /\ ledger' = [ledger EXCEPT ![k].cmp = "pending"]
    /\ cunsent' = cunsent \cup {k}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent, repQ,
                   unsent, hpc, hepoch, earlyAcks, fencedActs, nextId, budget>>

\* Under a fresh, one-use approval.
HCompensate(k) ==
    /\ HostIdle
    /\ k \in cunsent
    /\ ledger[k].cmp = "pending"
    /\ Publish("compensate", k)
    /\ cunsent' = cunsent \ {k}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, repQ, ledger,
                   unsent, hpc, hepoch, earlyAcks, fencedActs, budget>>

\* A compensation is looked up before it is sent again.
HReconcileCompensation(k) ==
    /\ HostIdle
    /\ k \notin cunsent
    /\ ledger[k].cmp = "pending"
    /\ Publish("creconcile", k)
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, repQ, hostVars,
                   fencedActs, budget>>

\* A reply the ledger refuses (fail closed: a copy for the operator): a
\* refusal for drift, or a terminal state other than the one it holds.
LedgerRefuses(r, e) ==
    LET cur == IF r.kind \in {"compensate", "creconcile"} THEN e.cmp ELSE e.op IN
    \/ r.val = "refused"
    \/ r.val \in Terminal /\ cur \in Terminal /\ cur # r.val /\ ~e.operator

\* The ledger entry of a reply's key once the reply is applied.
Applied(r, e) ==
    LET cmp == r.kind \in {"compensate", "creconcile"}
        cur == IF cmp THEN e.cmp ELSE e.op
    IN
    IF r.val \in Terminal /\ cur = "pending"
    THEN IF cmp THEN [e EXCEPT !.cmp = r.val] ELSE [e EXCEPT !.op = r.val]
    ELSE e  \* pending, unknown, poisoned, or what it holds: nothing to record

\* What the host may send after it: unknown means never admitted, so the
\* same key may go out again (never a new key).
Resend(r, e) ==
    r.val = "unknown" /\ (IF r.kind = "reconcile" THEN e.op = "pending" ELSE e.cmp = "pending")

\* A reply opened and applied to a copy of the ledger (in memory).
HApply(r) ==
    LET e == ledger[r.key] IN
    /\ HostIdle
    /\ r \in repQ
    /\ IF r.hep # hepoch \/ LedgerRefuses(r, e)
         THEN \* a reply to a session of an earlier incarnation, or refused by
              \* the ledger: dead-lettered
              /\ repQ' = repQ \ {r}
              /\ UNCHANGED <<hpc, earlyAcks>>
         ELSE /\ hpc' = [step |-> "applied", reply |-> r, entry |-> Applied(r, e)]
              /\ IF Bug = "host_ack_before_persist"
                   THEN /\ repQ' = repQ \ {r}
                        /\ earlyAcks' = earlyAcks + (IF Applied(r, e) = e THEN 0 ELSE 1)
                   ELSE UNCHANGED <<repQ, earlyAcks>>
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent, ledger,
                   unsent, cunsent, hepoch, fencedActs, nextId, budget>>

\* The ledger persisted (compare-and-swap), then the reply acked.
HPersistAck ==
    LET r == hpc.reply
        k == r.key
    IN
    /\ hpc.step = "applied"
    /\ ledger' = [ledger EXCEPT ![k] = hpc.entry]
    /\ repQ' = repQ \ {r}
    /\ hpc' = Idle
    /\ IF Resend(r, ledger[k]) /\ r.kind = "reconcile"
         THEN unsent' = unsent \cup {k} ELSE UNCHANGED unsent
    /\ IF Resend(r, ledger[k]) /\ r.kind = "creconcile"
         THEN cunsent' = cunsent \cup {k} ELSE UNCHANGED cunsent
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent,
                   hepoch, earlyAcks, fencedActs, nextId, budget>>

\* SIGKILL of the host: only its ledger stays; a new incarnation recovers
\* (every key not terminal is reconciled: HReconcile, HReconcileCompensation).
HostDies ==
    /\ budget.hcrash < MaxHostCrashes
    /\ budget' = [budget EXCEPT !.hcrash = @ + 1]
    /\ unsent' = {}
    /\ cunsent' = {}
    /\ hpc' = Idle
    /\ hepoch' = hepoch + 1
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent, repQ,
                   ledger, earlyAcks, fencedActs, nextId>>

HostCrashAfterLedgerCommit == unsent # {} /\ HostDies
HostCrashAfterCompensationIntent == cunsent # {} /\ HostDies
HostCrashAfterReplyApplied == hpc.step = "applied" /\ HostDies
HostCrashAfterRetryIntent == RetryKey # NoOp /\ RetryKey \in unsent /\ HostDies
HostCrashElsewhere == HostIdle /\ unsent = {} /\ cunsent = {} /\ HostDies

\* octo-host resolve: an operator decides a stuck key (no worker answer).
OperatorDecides(k, v) ==
    /\ HostIdle
    /\ budget.operator < MaxOperatorDecisions
    /\ budget' = [budget EXCEPT !.operator = @ + 1]
    /\ \/ /\ ledger[k].op = "pending"
          /\ ledger' = [ledger EXCEPT ![k].op = v, ![k].operator = TRUE]
       \/ /\ ledger[k].cmp = "pending"
          /\ ledger' = [ledger EXCEPT ![k].cmp = v, ![k].operator = TRUE]
    /\ unsent' = unsent \ {k}
    /\ cunsent' = cunsent \ {k}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent, repQ,
                   hpc, hepoch, earlyAcks, fencedActs, nextId>>

(***************************************************************************)
(* Broker faults                                                           *)
(***************************************************************************)

\* A request delivered again after its ack (a duplicate publish).
Duplicate(m) ==
    /\ m \in sent \ reqQ
    /\ budget.dup < MaxDuplicates
    /\ budget' = [budget EXCEPT !.dup = @ + 1]
    /\ reqQ' = reqQ \cup {m}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, sent, repQ,
                   hostVars, fencedActs, nextId>>

\* A reply that never reaches the host.
LoseReply(r) ==
    /\ r \in repQ
    /\ budget.lost < MaxLostReplies
    /\ budget' = [budget EXCEPT !.lost = @ + 1]
    /\ repQ' = repQ \ {r}
    /\ UNCHANGED <<journal, fence, lease, wstate, wpc, outbox, worldVars, reqQ, sent,
                   hostVars, fencedActs, nextId>>

Next ==
    \/ \E w \in Workers :
        \/ WStart(w) \/ WStop(w) \/ WAck(w) \/ WEffect(w) \/ WCEffect(w)
        \/ WObserve(w) \/ WPublish(w) \/ WRelease(w)
        \/ \E m \in reqQ : WHandle(w, m)
        \/ CrashAfterAdmissionCommit(w) \/ CrashAfterAck(w) \/ CrashAfterEffect(w)
        \/ CrashBeforeReply(w) \/ CrashAfterReply(w)
        \/ CrashAfterCompensationAdmissionCommit(w) \/ CrashAfterCompensationEffect(w)
        \/ WorkerCrashElsewhere(w)
    \/ \E k \in Keys :
        \/ HRecord(k) \/ HDispatch(k) \/ HReconcile(k)
        \/ HRecordCompensation(k) \/ HCompensate(k) \/ HReconcileCompensation(k)
        \/ \E v \in Terminal : OperatorDecides(k, v)
    \/ \E r \in repQ : HApply(r) \/ LoseReply(r)
    \/ HPersistAck
    \/ HRecordRetry
    \/ HostCrashAfterRetryIntent
    \/ HostCrashAfterLedgerCommit \/ HostCrashAfterCompensationIntent
    \/ HostCrashAfterReplyApplied \/ HostCrashElsewhere
    \/ \E m \in sent : Duplicate(m)

Spec == Init /\ [][Next]_vars


(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)

\* At most one effect per key, and at most one inverse effect (one compensation).
AtMostOncePerKey == \A k \in Keys : effects[k] <= 1 /\ ceffects[k] <= 1

\* No effect without a durable admission.
NoEffectWithoutAdmission ==
    \A k \in Keys :
        /\ effects[k] > 0 => journal[k].op # NoOp
        /\ ceffects[k] > 0 => journal[k].cmp # NoOp

\* No compensation unless the original succeeded.
CompensationOnlyAfterSuccess ==
    \A k \in Keys : ceffects[k] > 0 => (effects[k] = 1 /\ journal[k].op = "succeeded")

\* A fenced-out worker commits and publishes nothing.
FencedOutCommitsNothing == fencedActs = 0

\* Recovery never runs an effect twice: the adapter is called at most once a key.
RecoveryNeverRerunsAnEffect == \A k \in Keys : calls[k] <= 1 /\ ccalls[k] <= 1

\* The host acks a reply only once the ledger change it carries is durable.
HostAcksOnlyDurableReplies == earlyAcks = 0

\* Every effect known afterwards: a state the ledger holds from a worker's
\* answer is the journal's, and the world agrees with it.
LedgerAgreesWithJournal ==
    \A k \in Keys :
        /\ (ledger[k].op \in Terminal /\ ~ledger[k].operator) => ledger[k].op = journal[k].op
        /\ (ledger[k].cmp \in Terminal /\ ~ledger[k].operator) => ledger[k].cmp = journal[k].cmp
        /\ journal[k].op = "succeeded" => effects[k] = 1
        /\ journal[k].op = "failed" => effects[k] = 0
        /\ journal[k].cmp = "succeeded" => ceffects[k] = 1
        /\ journal[k].cmp = "failed" => ceffects[k] = 0

=============================================================================
