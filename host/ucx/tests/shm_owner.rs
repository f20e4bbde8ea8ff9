//! Real worker addresses and keys read for their owner ([`kvferry_ucx::PeerProcess`]): every
//! shared-memory transport of a worker of this process names this process, and a key of a
//! region it allocated is its own; a `tcp` worker names none and its keys pass untouched.
//! (Keys of another process are in `kvferry-transfer`'s suite, `key_owner.rs`.)

use crate::common;

use common::Transport;
use kvferry_ucx::shm_owner::{ShmTransport, address_entries};
use kvferry_ucx::{Context, MemRegion, PeerProcess, Worker};

fn release() -> (u32, u32) {
    let (major, minor, _) = kvferry_ucx::library::release();
    (major, minor)
}

#[test]
fn a_shm_worker_of_this_process_names_this_process_and_its_keys_pass() {
    for tls in ["posix,sysv,self", "posix,sysv,cma,self"] {
        let ctx = Context::builder().tls(tls).build().expect("context");
        let worker = Worker::new(&ctx).expect("worker");
        let address = worker.address().unwrap();
        let entries = address_entries(&address, release()).unwrap();
        let shm: Vec<ShmTransport> = entries.iter().filter_map(|e| e.shm()).collect();
        for want in [
            ShmTransport::Posix,
            ShmTransport::Sysv,
            ShmTransport::Loopback,
        ] {
            assert!(shm.contains(&want), "{tls}: {want} in {entries:?}");
        }
        let peer = PeerProcess::of_address(&address).unwrap();
        assert_eq!(peer.pid(), Some(std::process::id()), "{tls}");
        let region = MemRegion::allocate(&ctx, 1 << 20).expect("region");
        let key = region.pack_rkey().unwrap().into_bytes();
        peer.check_key(&key).unwrap();
    }
}

#[test]
fn a_tcp_worker_names_no_process_and_its_keys_pass() {
    let ctx = Transport::Tcp.context();
    let worker = Worker::new(&ctx).expect("worker");
    let peer = PeerProcess::of_address(&worker.address().unwrap()).unwrap();
    assert_eq!(peer.pid(), None);
    let region = MemRegion::allocate(&ctx, 1 << 16).expect("region");
    peer.check_key(&region.pack_rkey().unwrap().into_bytes())
        .unwrap();
}
