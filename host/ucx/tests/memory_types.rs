//! Memory types: what the loaded UCX reports, and puts into memory registered with an explicit
//! type (host here; CUDA device memory is exercised by `kvferry`'s `cuda` tests on a GPU).

mod common;

use common::{Transport, drive, pattern};
use kvferry_ucx::{MemRegion, MemoryType, Worker};

const LEN: usize = 256 << 10;

/// Host memory is always supported. Nothing is asserted about CUDA: Debian's UCX 1.13.1 has no
/// CUDA transports and reports `host` alone, a CUDA-enabled build reports `cuda` too, and both
/// must pass.
#[test]
fn host_memory_is_always_reported() {
    for transport in [Transport::Shm, Transport::Tcp, Transport::Env] {
        let types = transport.context().memory_types().unwrap();
        println!(
            "UCX {} ({transport:?}): memory types {types} (mask {:#x}), cuda: {}",
            kvferry_ucx::version(),
            types.bits(),
            types.contains_cuda()
        );
        assert!(types.contains(MemoryType::HOST), "{transport:?}: {types}");
        assert!(types.iter().any(|t| t == MemoryType::HOST));
        assert!(types.to_string().starts_with("host"), "{types}");
    }
}

/// A put from a host-typed source region into a host-typed registered target, both mapped with
/// `register_with_memory_type`, checked byte for byte.
fn put_between_typed_regions(transport: Transport) {
    let ctx_b = transport.context();
    let b = Worker::new(&ctx_b).unwrap();
    let mut target = vec![0u8; LEN];
    // SAFETY: `target` is a live, initialised host allocation of `LEN` bytes, neither touched
    // nor freed until after the region is dropped below.
    let region = unsafe {
        MemRegion::register_with_memory_type(&ctx_b, target.as_mut_ptr(), LEN, MemoryType::HOST)
    }
    .unwrap();
    assert_eq!(region.memory_type(), MemoryType::HOST);
    assert!(!region.is_allocated());

    let ctx_a = transport.context();
    let a = Worker::new(&ctx_a).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let rkey = ep
        .unpack_rkey(region.pack_rkey().unwrap().as_bytes())
        .unwrap();

    let expected = pattern(LEN, 0x5A);
    let mut source_bytes = expected.clone();
    // SAFETY: as for `target`: live, initialised, untouched until the region is dropped.
    let source = unsafe {
        MemRegion::register_with_memory_type(
            &ctx_a,
            source_bytes.as_mut_ptr(),
            LEN,
            MemoryType::HOST,
        )
    }
    .unwrap();
    let request = ep
        .put_region(&source, 0, LEN, region.remote_addr(), &rkey)
        .unwrap();
    drive(request, &[&a, &b]).unwrap();
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();

    drop(rkey);
    drop(ep);
    drop(source);
    drop(region);
    assert!(target == expected, "typed target differs from what was put");
}

#[test]
fn put_host_typed_shm() {
    put_between_typed_regions(Transport::Shm);
}

#[test]
fn put_host_typed_tcp() {
    put_between_typed_regions(Transport::Tcp);
}
