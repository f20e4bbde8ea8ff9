//! A peer's declared pools are checked against what their keys map before anything is put
//! through them: a receiver that declares pool 0 at `0x1000` with the real key of its pool
//! would otherwise make the sender write at a wild address over shared memory (and crash).

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use kvferry_plan::{ValidatedPlan, error_chain};
use kvferry_protocol::PoolKey;
use kvferry_transfer::Transport;
use kvferry_transfer::harness::rank::{RemoteRank, WriteError, WriteJob};

use support::ranks::{POOL, Rank, WAIT, one_fragment, rank, remote, vet, write};

const WILD: u64 = 0x1000;

/// The receiver's real pool 0 key, declared at `base`.
fn declared_at(receiver: &Rank, base: u64) -> Vec<PoolKey> {
    let mut pool = receiver.keys[0].clone();
    pool.base = base;
    vec![pool]
}

/// A plan of one fragment from the sender's pool to `dst`.
fn plan(sender: &Rank, dst: u64, len: u64) -> ValidatedPlan {
    one_fragment(sender.keys[0].base, dst, len)
}

fn assert_key_range(result: Result<(), WriteError>, base: u64, len: u64) {
    match result {
        Err(WriteError::KeyRange {
            pool: 0,
            base: b,
            len: l,
            ..
        }) if b == base && l == len => {}
        other => panic!("expected KeyRange for {base:#x} +{len}, got {other:?}"),
    }
}

#[test]
fn vet_refuses_a_pool_declared_outside_its_key_over_shm() {
    let receiver = rank("decode", Transport::Shm);
    let sender = rank("prefill", Transport::Shm);

    let err = vet(&sender, remote(&receiver, 1, declared_at(&receiver, WILD))).unwrap_err();
    assert_eq!(
        error_chain(&err),
        format!(
            "decode rank 0 declares pool 0 at 0x1000 +{POOL}, but its key does not map that range \
             into this process: ucp_rkey_ptr failed: address not valid"
        )
    );
    assert_key_range(Err(err), WILD, POOL);

    // One byte longer than the pool, or starting one byte into the next page of memory.
    let mut long = receiver.keys.clone();
    long[0].len += 1;
    assert_key_range(
        vet(&sender, remote(&receiver, 2, long)),
        receiver.keys[0].base,
        POOL + 1,
    );
    let base = receiver.keys[0].base + 1;
    assert_key_range(
        vet(&sender, remote(&receiver, 3, declared_at(&receiver, base))),
        base,
        POOL,
    );
}

#[test]
fn vet_accepts_a_correct_declaration_and_the_write_lands() {
    let receiver = rank("decode", Transport::Shm);
    let sender = rank("prefill", Transport::Shm);
    let dest = remote(&receiver, 1, receiver.keys.clone());
    vet(&sender, Arc::clone(&dest)).expect("a correct declaration vets");

    let bytes: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8 + 1).collect();
    // SAFETY: no job reads the sender's pool yet, and no peer writes it.
    unsafe { sender.pools.write(0, 0, &bytes) }.unwrap();
    let at = receiver.keys[0].base + 4096;
    let (result, released) = write(&sender, dest, plan(&sender, at, 4096));
    let written = result.expect("write");
    assert_eq!(
        (written.bytes, written.fragments, written.puts),
        (4096, 1, 1),
        "{written:?}"
    );
    assert!(released);
    let mut landed = vec![0; 4096];
    receiver.pools.read(0, 4096, &mut landed).unwrap();
    assert!(landed == bytes, "the bytes landed where the plan put them");
}

#[test]
fn a_write_job_to_a_pool_declared_outside_its_key_fails_and_puts_nothing() {
    let receiver = rank("decode", Transport::Shm);
    let sender = rank("prefill", Transport::Shm);
    let dest = remote(&receiver, 1, declared_at(&receiver, WILD));
    let (result, released) = write(&sender, Arc::clone(&dest), plan(&sender, WILD, 64));
    match result {
        Err(WriteError::KeyRange { base: WILD, .. }) => {}
        other => panic!("expected KeyRange, got {other:?}"),
    }
    assert!(released, "the job's sources are released");
    // Refused again on the next job (a refused connection is not cached), and the thread
    // still serves others.
    let (again, _) = write(&sender, dest, plan(&sender, WILD, 64));
    assert!(
        matches!(again, Err(WriteError::KeyRange { .. })),
        "{again:?}"
    );
    vet(&sender, remote(&receiver, 2, receiver.keys.clone())).expect("still serving");
}

/// Over tcp the sender translates nothing (UCX emulates puts with active messages that the
/// receiver applies), so there is nothing for the sender to check and the key vets.
#[test]
fn over_tcp_the_sender_does_not_translate_so_vet_passes() {
    let receiver = rank("decode", Transport::Tcp);
    let sender = rank("prefill", Transport::Tcp);
    vet(&sender, remote(&receiver, 1, declared_at(&receiver, WILD))).expect("not mappable: passes");
}

/// A key cut short is refused at vet, naming what is wrong with it, over tcp and shm: UCX
/// parses a key without a length, and the first 4 bytes of a real 9-byte tcp key crashed the
/// sender inside `ucp_ep_rkey_unpack`. So is a bounce arena's short key (its index: the pool
/// count), and the thread goes on serving.
#[test]
fn vet_refuses_a_truncated_key_by_name() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let receiver = rank("decode", transport);
        let sender = rank("prefill", transport);
        let mut short = receiver.keys.clone();
        short[0].rkey.truncate(4);
        let err = vet(&sender, remote(&receiver, 1, short)).unwrap_err();
        assert_eq!(
            error_chain(&err),
            "cannot unpack the remote key of decode rank 0 pool 0: ucp_ep_rkey_unpack not called: \
             malformed remote key: 4 bytes, fewer than the 9 of its header (a 64-bit md map and \
             a memory type)",
            "{transport:?}"
        );

        let mut bounce = receiver.keys[0].clone();
        bounce.rkey.truncate(1);
        let dest = Arc::new(RemoteRank {
            bounce: Some(bounce),
            ..Arc::unwrap_or_clone(remote(&receiver, 2, receiver.keys.clone()))
        });
        match vet(&sender, dest) {
            Err(WriteError::UnpackKey {
                pool: 1, source, ..
            }) => assert!(
                source.key_format().is_some(),
                "{transport:?}: refused by UCX, not by the layout check: {source:?}"
            ),
            other => panic!("{transport:?}: expected UnpackKey for pool 1, got {other:?}"),
        }
        vet(&sender, remote(&receiver, 3, receiver.keys.clone())).expect("still serving");
    }
}

#[test]
fn vet_on_a_stopped_thread_replies_at_once() {
    let receiver = rank("decode", Transport::Shm);
    let sender = rank("prefill", Transport::Shm);
    // A completion callback that panics ends the rank thread.
    sender.thread.write(WriteJob {
        request: 1,
        dest: remote(&receiver, 1, receiver.keys.clone()),
        plan: Arc::new(plan(&sender, receiver.keys[0].base, 64)),
        timeout: Duration::from_secs(10),
        hook: None,
        done: Box::new(|_| panic!("injected: the rank thread ends")),
        release: None,
        bounce: None,
    });
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match vet(&sender, remote(&receiver, 2, receiver.keys.clone())) {
            Err(WriteError::Stopped { rank: 0 }) => break,
            // Vetted before the thread ended: the reply came from the thread.
            Ok(()) => {}
            Err(other) => panic!("{other:?}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the thread did not stop"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
