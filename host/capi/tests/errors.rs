//! The C API's refusals, called the way C calls it (the extern functions, raw pointers):
//! NULL arguments, bad configurations, calls that do not fit the role, unknown requests and
//! small buffers each return their status and leave the reason in `kvferry_last_error`, and
//! a success clears it. Also: events that do not fit the caller's array wait for the next
//! poll with the wake descriptor still readable.

mod support;

use std::ffi::{CStr, CString, c_char, c_int};
use std::ptr::{null, null_mut};
use std::time::Duration;

use kvferry_capi::kvferry_status::*;
use kvferry_capi::*;

fn last_error() -> String {
    // SAFETY: a NULL buffer with cap 0 asks for the length only.
    let len = unsafe { kvferry_last_error(null_mut(), 0) };
    let mut buf = vec![0 as c_char; len + 1];
    // SAFETY: `buf` has `len + 1` writable bytes.
    let again = unsafe { kvferry_last_error(buf.as_mut_ptr(), buf.len()) };
    assert_eq!(again, len);
    // SAFETY: kvferry_last_error NUL-terminated it.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string()
}

fn status(code: kvferry_status) -> c_int {
    code as c_int
}

/// Engine memory for one pool, page-aligned, zeroed, freed on drop.
struct Pool {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Pool {
    fn new(bytes: usize) -> Pool {
        let layout = std::alloc::Layout::from_size_align(bytes, 4096).unwrap();
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Pool { ptr, layout }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// A configuration over `pool`: one layer, K and V of 1 KiB each per 16-token block.
fn config(role: &str, pool: &Pool, plugins: &std::path::Path, extra: &str) -> String {
    format!(
        r#"{{"version": 1, "instance": "{role}-t", "role": "{role}", "architecture": "llama",
            "planner": "kvferry.default", "plugin_dir": "{dir}", "listen": "127.0.0.1:0",
            "secret": "a secret of sixteen bytes or more",
            "rank": {{"mapping": "tp1", "instance_rank": 0, "layers_per_pp": [1],
              "page_table": {{"tokens_per_block": 16,
                "pools": [{{"base": {base}, "slot_bytes": 2048, "num_slots": 8}}],
                "groups": [{{"layers": [{{"local": 0, "global": 0}}],
                  "views": [{{"pool": 0, "roles": ["key", "value"],
                    "entries": [{{"local_layer": 0, "offset": 0, "size": 1024}},
                                {{"local_layer": 0, "offset": 1024, "size": 1024}}],
                    "layout": {{"kind": "hnd", "dtype": "bf16", "elem_bits": 16,
                                "shard_unit_bytes": 1024}}}}]}}]}}}}{extra}}}"#,
        dir = support::json_path(plugins),
        base = pool.ptr as u64,
    )
}

/// Starts an agent, or returns the status and the last error.
fn start(json: &str) -> Result<*mut kvferry_agent, (c_int, String)> {
    let json = CString::new(json).unwrap();
    // Not NULL, so a failed start that forgot to clear it shows.
    let mut agent = std::ptr::dangling_mut::<kvferry_agent>();
    // SAFETY: a NUL-terminated string and a writable out-pointer.
    let rc = unsafe { kvferry_agent_start(json.as_ptr(), &mut agent) };
    if rc == status(KVFERRY_OK) {
        assert!(!agent.is_null());
        Ok(agent)
    } else {
        assert!(agent.is_null(), "a failed start left a handle");
        Err((rc, last_error()))
    }
}

fn refused(json: &str, want: kvferry_status, text: &str) {
    match start(json) {
        Ok(agent) => {
            // SAFETY: a live handle, destroyed once.
            unsafe { kvferry_agent_destroy(agent) };
            panic!("started with {json}");
        }
        Err((rc, why)) => {
            assert_eq!(rc, status(want), "{why}");
            assert!(why.contains(text), "{why:?} lacks {text:?}");
            assert!(why.starts_with("kvferry_agent_start: "), "{why}");
        }
    }
}

#[test]
fn bad_configurations_are_refused_with_their_reason() {
    let pool = Pool::new(8 * 2048);
    let plugins = support::plugin_dir();
    let good = config("generation", &pool, plugins.path(), "");

    // SAFETY: NULL arguments are what is tested; nothing is dereferenced.
    let rc = unsafe { kvferry_agent_start(null(), null_mut()) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
    assert_eq!(last_error(), "kvferry_agent_start: out is NULL");
    let mut agent = null_mut();
    // SAFETY: as above, with a writable out-pointer.
    let rc = unsafe { kvferry_agent_start(null(), &mut agent) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
    assert!(last_error().contains("config_json is NULL"));
    let good_c = CString::new(good.clone()).unwrap();
    // SAFETY: a valid config but a NULL out-pointer.
    let rc = unsafe { kvferry_agent_start(good_c.as_ptr(), null_mut()) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));

    refused("{not json", KVFERRY_ERR_CONFIG, "config is not JSON");
    refused(
        &good.replacen("\"version\": 1", "\"version\": 2", 1),
        KVFERRY_ERR_CONFIG,
        "config version 2 is not supported (this library reads version 1)",
    );
    refused(
        &good.replacen("\"version\": 1,", "", 1),
        KVFERRY_ERR_CONFIG,
        "no \"version\"",
    );
    refused(
        &config("generation", &pool, plugins.path(), r#", "timeout": 5"#),
        KVFERRY_ERR_CONFIG,
        "unknown field `timeout`",
    );
    refused(
        &good.replace("\"hnd\"", "\"hdn\""),
        KVFERRY_ERR_CONFIG,
        "layout.kind `hdn` is unknown (known: hnd, nhd, replicated, sectioned)",
    );
    refused(
        &good.replace(
            "\"slot_bytes\": 2048",
            "\"slot_bytes\": 2048, \"slot_stride\": 1024",
        ),
        KVFERRY_ERR_CONFIG,
        "slot_stride 1024 is smaller than slot_bytes 2048",
    );
    refused(
        &good.replace("a secret of sixteen bytes or more", "short"),
        KVFERRY_ERR_CONFIG,
        "at least 16 bytes",
    );
    refused(
        &good.replace("\"kvferry.default\"", "\"kvferry.nonexistent\""),
        KVFERRY_ERR_PLANNER,
        "kvferry.nonexistent",
    );
    let empty = tempfile::tempdir().unwrap();
    refused(
        &config("generation", &pool, empty.path(), ""),
        KVFERRY_ERR_PLANNER,
        "no planner loaded from",
    );
    refused(
        &good.replace("\"transport\"", "\"x\"").replacen(
            "\"listen\"",
            "\"transport\": \"carrier-pigeon\", \"listen\"",
            1,
        ),
        KVFERRY_ERR_CONFIG,
        "unknown transport `carrier-pigeon`",
    );
    // Text that is not UTF-8.
    let bad = CString::new(vec![b'{', 0xff, b'}']).unwrap();
    let mut agent = null_mut();
    // SAFETY: a NUL-terminated string and a writable out-pointer.
    let rc = unsafe { kvferry_agent_start(bad.as_ptr(), &mut agent) };
    assert_eq!(rc, status(KVFERRY_ERR_INVALID_ARGUMENT), "{}", last_error());
}

#[test]
fn calls_on_a_live_agent_check_every_pointer_role_and_request() {
    let pool = Pool::new(8 * 2048);
    let plugins = support::plugin_dir();
    let agent = start(&config("generation", &pool, plugins.path(), "")).unwrap();
    assert_eq!(last_error(), "", "a success clears the last error");

    // Unknown request.
    // SAFETY: a live handle.
    let rc = unsafe { kvferry_agent_cancel(agent, 42) };
    assert_eq!(rc, status(KVFERRY_ERR_UNKNOWN_REQUEST));
    assert_eq!(
        last_error(),
        "kvferry_agent_cancel: request 42 is unknown or has ended"
    );
    // SAFETY: NULL is what is tested.
    let rc = unsafe { kvferry_agent_cancel(null_mut(), 42) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
    assert_eq!(last_error(), "kvferry_agent_cancel: agent is NULL");

    // The role: a decode rank neither listens nor sends.
    let mut len = 0usize;
    // SAFETY: a live handle and a size query.
    let rc = unsafe { kvferry_agent_endpoint(agent, null_mut(), 0, &mut len) };
    assert_eq!(rc, status(KVFERRY_ERR_ROLE));
    assert!(last_error().contains("no endpoint"));
    let slots = [0i32, 1];
    let table = kvferry_slot_table {
        slots: slots.as_ptr(),
        len: 2,
    };
    // SAFETY: a live handle and a valid table.
    let rc = unsafe { kvferry_agent_send(agent, 1, &table, 1, 0, 32, 32, true, null()) };
    assert_eq!(rc, status(KVFERRY_ERR_ROLE));
    assert!(
        last_error().contains("send is for prefill ranks"),
        "{}",
        last_error()
    );

    // Expect: NULL peer, NULL tables with a length, a NULL endpoint entry, bad slots.
    let peer = CString::new("prefill-t").unwrap();
    // SAFETY: each call passes one NULL where the tested argument is; the rest are valid.
    unsafe {
        let rc = kvferry_agent_expect(agent, 1, null(), null(), 0, 0, 32, 0, &table, 1, null(), 0);
        assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
        assert!(last_error().contains("peer is NULL"));
        let rc = kvferry_agent_expect(
            agent,
            1,
            peer.as_ptr(),
            null(),
            0,
            0,
            32,
            0,
            null(),
            1,
            null(),
            0,
        );
        assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
        assert!(
            last_error().contains("tables (with 1 entries) is NULL"),
            "{}",
            last_error()
        );
        let endpoints = [null::<c_char>()];
        let rc = kvferry_agent_expect(
            agent,
            1,
            peer.as_ptr(),
            endpoints.as_ptr(),
            1,
            0,
            32,
            0,
            &table,
            1,
            null(),
            0,
        );
        assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
        assert!(
            last_error().contains("endpoints[0] is NULL"),
            "{}",
            last_error()
        );
        let outside = [0i32, 99];
        let bad = kvferry_slot_table {
            slots: outside.as_ptr(),
            len: 2,
        };
        let rc = kvferry_agent_expect(
            agent,
            1,
            peer.as_ptr(),
            null(),
            0,
            0,
            32,
            0,
            &bad,
            1,
            null(),
            0,
        );
        assert_eq!(rc, status(KVFERRY_ERR_INVALID_REQUEST), "{}", last_error());
        assert!(last_error().contains("99"), "{}", last_error());
        // A table short of the tokens: two 16-token blocks for 40 tokens. It used
        // to be taken, and the request reported received with its last 8 tokens unmoved.
        let rc = kvferry_agent_expect(
            agent,
            1,
            peer.as_ptr(),
            null(),
            0,
            0,
            40,
            0,
            &table,
            1,
            null(),
            0,
        );
        assert_eq!(rc, status(KVFERRY_ERR_INVALID_REQUEST), "{}", last_error());
        assert!(
            last_error().contains("2 entries of 16 tokens")
                && last_error().contains("run to 40")
                && last_error().contains("takes 3 entries"),
            "{}",
            last_error()
        );
    }

    // Metadata: size query, too small, then the bytes.
    let mut len = 0usize;
    // SAFETY: a live handle and a size query.
    let rc = unsafe { kvferry_agent_local_metadata(agent, null_mut(), 0, &mut len) };
    assert_eq!(rc, status(KVFERRY_OK));
    assert!(len > 64, "{len}");
    let mut small = vec![0xEEu8; 8];
    let mut got = 0usize;
    // SAFETY: a live handle and an 8-byte buffer.
    let rc = unsafe { kvferry_agent_local_metadata(agent, small.as_mut_ptr(), 8, &mut got) };
    assert_eq!(rc, status(KVFERRY_ERR_BUFFER_TOO_SMALL));
    assert_eq!(got, len);
    assert!(
        small.iter().all(|b| *b == 0xEE),
        "a too-small buffer was written"
    );
    let mut buf = vec![0u8; len];
    // SAFETY: a live handle and a `len`-byte buffer.
    let rc = unsafe { kvferry_agent_local_metadata(agent, buf.as_mut_ptr(), len, &mut got) };
    assert_eq!(rc, status(KVFERRY_OK));
    // SAFETY: a live handle and NULL `len_out`.
    let rc = unsafe { kvferry_agent_local_metadata(agent, buf.as_mut_ptr(), len, null_mut()) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
    // A decode rank refuses a decode rank's metadata; garbage is refused too.
    // SAFETY: a live handle and `len` readable bytes.
    let rc = unsafe { kvferry_agent_add_peer(agent, buf.as_ptr(), len) };
    assert_eq!(rc, status(KVFERRY_ERR_METADATA));
    assert!(
        last_error().contains("a decode rank adds prefill ranks"),
        "{}",
        last_error()
    );
    // SAFETY: a live handle and 3 readable bytes.
    let rc = unsafe { kvferry_agent_add_peer(agent, b"abc".as_ptr(), 3) };
    assert_eq!(rc, status(KVFERRY_ERR_METADATA));
    // SAFETY: a live handle and NULL bytes.
    let rc = unsafe { kvferry_agent_add_peer(agent, null(), 0) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));

    // Poll: NULL out-count, NULL array with room, an empty poll.
    let mut n = 7usize;
    // SAFETY: each call passes one NULL where the tested argument is.
    unsafe {
        assert_eq!(
            kvferry_agent_poll(agent, null_mut(), 0, null_mut()),
            status(KVFERRY_ERR_NULL_POINTER)
        );
        assert_eq!(
            kvferry_agent_poll(agent, null_mut(), 4, &mut n),
            status(KVFERRY_ERR_NULL_POINTER)
        );
        assert_eq!(
            kvferry_agent_poll(agent, null_mut(), 0, &mut n),
            status(KVFERRY_OK)
        );
        assert_eq!(n, 0);
        assert!(kvferry_agent_wake_fd(agent) >= 0);
        assert_eq!(kvferry_agent_wake_fd(null()), -1);
    }
    assert_eq!(last_error(), "kvferry_agent_wake_fd: agent is NULL");

    // SAFETY: a live handle, destroyed once; NULL is ignored.
    unsafe {
        kvferry_agent_destroy(agent);
        kvferry_agent_destroy(null_mut());
    }
    // The last error is snprintf-like: cut, NUL-terminated, full length returned.
    // SAFETY: NULL is what is tested.
    unsafe { kvferry_agent_cancel(null_mut(), 1) };
    let mut four = [1 as c_char; 4];
    // SAFETY: a 4-byte buffer.
    let full = unsafe { kvferry_last_error(four.as_mut_ptr(), 4) };
    assert_eq!(full, "kvferry_agent_cancel: agent is NULL".len());
    assert_eq!(four.map(|c| c as u8), *b"kvf\0");
}

fn readable(fd: c_int) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the call; no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

#[test]
fn events_that_do_not_fit_wait_for_the_next_poll() {
    // Three sends nobody claims fail at a 50 ms lease: three FAILED events, drained one at
    // a time.
    let pool = Pool::new(8 * 2048);
    let plugins = support::plugin_dir();
    let agent = start(&config(
        "context",
        &pool,
        plugins.path(),
        r#", "lease_ms": 50"#,
    ))
    .unwrap();
    let mut len = 0usize;
    // SAFETY: a live handle and a size query.
    let rc = unsafe { kvferry_agent_endpoint(agent, null_mut(), 0, &mut len) };
    assert_eq!(rc, status(KVFERRY_OK));
    let mut endpoint = vec![0 as c_char; len + 1];
    // SAFETY: `len` + 1 writable bytes.
    let rc = unsafe { kvferry_agent_endpoint(agent, endpoint.as_mut_ptr(), len, &mut len) };
    assert_eq!(
        rc,
        status(KVFERRY_ERR_BUFFER_TOO_SMALL),
        "no room for the NUL"
    );
    // SAFETY: as above, with room for the NUL.
    let rc = unsafe { kvferry_agent_endpoint(agent, endpoint.as_mut_ptr(), len + 1, &mut len) };
    assert_eq!(rc, status(KVFERRY_OK));
    // SAFETY: NUL-terminated by the call.
    let endpoint = unsafe { CStr::from_ptr(endpoint.as_ptr()) }
        .to_str()
        .unwrap();
    assert!(endpoint.starts_with("127.0.0.1:"), "{endpoint}");
    assert_eq!(endpoint.len(), len);

    let slots = [0i32, 1];
    let table = kvferry_slot_table {
        slots: slots.as_ptr(),
        len: 2,
    };
    // A table short of the tokens is refused at the call, as the engine's error:
    // two 16-token blocks for a 40-token prompt.
    // SAFETY: a live handle and a valid (short) table.
    let rc = unsafe { kvferry_agent_send(agent, 9, &table, 1, 0, 40, 40, true, null()) };
    assert_eq!(rc, status(KVFERRY_ERR_INVALID_REQUEST), "{}", last_error());
    assert!(last_error().contains("takes 3 entries"), "{}", last_error());
    for request in 1..=3 {
        // SAFETY: a live handle and a valid table.
        let rc = unsafe { kvferry_agent_send(agent, request, &table, 1, 0, 32, 32, true, null()) };
        assert_eq!(rc, status(KVFERRY_OK), "{}", last_error());
    }
    // SAFETY: a live handle and a valid table: the id is taken.
    let rc = unsafe { kvferry_agent_send(agent, 1, &table, 1, 0, 32, 32, true, null()) };
    assert_ne!(rc, status(KVFERRY_OK));

    // SAFETY: a live handle.
    let fd = unsafe { kvferry_agent_wake_fd(agent) };
    // The reaper fails each send within a few of its 20 ms periods of the lease; a second
    // is ample, and then all three wait at once.
    std::thread::sleep(Duration::from_secs(1));
    let mut events = Vec::new();
    for left in (0..3).rev() {
        assert!(
            readable(fd),
            "{} events wait, the descriptor is not readable",
            left + 1
        );
        let mut one = std::mem::MaybeUninit::<kvferry_event>::uninit();
        let mut n = 0usize;
        // SAFETY: room for one event.
        let rc = unsafe { kvferry_agent_poll(agent, one.as_mut_ptr(), 1, &mut n) };
        assert_eq!((rc, n), (status(KVFERRY_OK), 1));
        // SAFETY: the call wrote one event.
        events.push(unsafe { one.assume_init() });
        assert_eq!(readable(fd), left > 0, "{left} events left over");
    }
    let mut ids: Vec<u64> = events.iter().map(|e| e.request).collect();
    ids.sort();
    assert_eq!(ids, [1, 2, 3]);
    for e in &events {
        assert_eq!(e.kind, kvferry_event_kind::KVFERRY_EVENT_FAILED);
        assert_eq!(e.failure, kvferry_failure_kind::KVFERRY_FAILURE_LEASE);
        // SAFETY: NUL-terminated by the library.
        let detail = unsafe { CStr::from_ptr(e.detail.as_ptr()) }
            .to_str()
            .unwrap();
        assert!(!detail.is_empty());
        assert_eq!(e.flags & KVFERRY_EVENT_DETAIL_TRUNCATED, 0);
    }
    assert!(!readable(fd), "nothing waits any more");
    // SAFETY: a live handle, destroyed once.
    unsafe { kvferry_agent_destroy(agent) };
}

/// A send that starts a request again while one of that id is in flight (its last send in,
/// not ended) is a duplicate, as a second expect of an id is on a decode rank; a send after
/// the last that does not start over is still refused as a request that takes no more.
#[test]
fn a_second_send_of_a_request_in_flight_is_a_duplicate() {
    let pool = Pool::new(8 * 2048);
    let plugins = support::plugin_dir();
    let agent = start(&config("context", &pool, plugins.path(), "")).unwrap();
    let slots = [0i32, 1];
    let table = kvferry_slot_table {
        slots: slots.as_ptr(),
        len: 2,
    };
    let send = |start: u64, end: u64| {
        // SAFETY: a live handle and a valid table of two blocks.
        unsafe { kvferry_agent_send(agent, 7, &table, 1, start, end, 32, true, null()) }
    };
    assert_eq!(send(0, 32), status(KVFERRY_OK), "{}", last_error());
    assert_eq!(
        send(0, 32),
        status(KVFERRY_ERR_DUPLICATE),
        "{}",
        last_error()
    );
    assert_eq!(last_error(), "kvferry_agent_send: request 7 already exists");
    assert_eq!(
        send(16, 32),
        status(KVFERRY_ERR_UNKNOWN_REQUEST),
        "{}",
        last_error()
    );
    // SAFETY: a live handle, destroyed once.
    unsafe { kvferry_agent_destroy(agent) };
}

#[test]
fn layer_wise_sends_name_views_and_holds_are_for_decode_ranks() {
    let pool = Pool::new(8 * 2048);
    let plugins = support::plugin_dir();
    let agent = start(&config("context", &pool, plugins.path(), "")).unwrap();
    let slots = [0i32, 1];
    let table = kvferry_slot_table {
        slots: slots.as_ptr(),
        len: 2,
    };
    let send = |request: u64, views: *const kvferry_view_id, n: usize| {
        // SAFETY: a live handle, a valid table, `views` as each case gives it.
        unsafe {
            kvferry_agent_send_views(agent, request, &table, 1, 0, 32, 32, true, null(), views, n)
        }
    };
    let unknown = [kvferry_view_id { group: 5, view: 0 }];
    assert_eq!(
        send(1, unknown.as_ptr(), 1),
        status(KVFERRY_ERR_INVALID_REQUEST)
    );
    assert_eq!(
        last_error(),
        "kvferry_agent_send_views: request 1: view (group 5, view 0) is not a view of this \
         rank's page table"
    );
    assert_eq!(send(1, null(), 2), status(KVFERRY_ERR_NULL_POINTER));
    assert_eq!(
        last_error(),
        "kvferry_agent_send_views: views (with 2 entries) is NULL"
    );
    // The rank's one view by name, and NULL with none: every view.
    let only = [kvferry_view_id { group: 0, view: 0 }];
    assert_eq!(send(1, only.as_ptr(), 1), status(KVFERRY_OK));
    assert_eq!(send(2, null(), 0), status(KVFERRY_OK));
    // Holding is for decode ranks; a NULL peer is named.
    let peer = CString::new("prefill-t").unwrap();
    let ids = [1u64];
    // SAFETY: a live handle, a NUL-terminated peer, no endpoints, one id.
    let rc = unsafe { kvferry_agent_hold(agent, peer.as_ptr(), null(), 0, ids.as_ptr(), 1) };
    assert_eq!(rc, status(KVFERRY_ERR_ROLE));
    assert!(
        last_error().contains("hold is for decode ranks"),
        "{}",
        last_error()
    );
    // SAFETY: a NULL peer is what is tested.
    let rc = unsafe { kvferry_agent_hold(agent, null(), null(), 0, ids.as_ptr(), 1) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
    assert_eq!(last_error(), "kvferry_agent_hold: peer is NULL");
    // Its stats: two requests held, nothing ended yet; NULL out is named.
    let mut stats = kvferry_agent_stats::default();
    // SAFETY: a live handle and a writable struct.
    let rc = unsafe { kvferry_agent_get_stats(agent, &mut stats) };
    assert_eq!(rc, status(KVFERRY_OK));
    assert_eq!((stats.in_flight, stats.sent, stats.peers), (2, 0, 0));
    assert!(
        stats
            .failed
            .iter()
            .chain(&stats.latency_us_log2)
            .all(|&n| n == 0)
    );
    // SAFETY: NULL out is what is tested.
    let rc = unsafe { kvferry_agent_get_stats(agent, null_mut()) };
    assert_eq!(rc, status(KVFERRY_ERR_NULL_POINTER));
    assert_eq!(last_error(), "kvferry_agent_get_stats: out is NULL");
    // The same numbers for Prometheus: the size, a buffer one byte short, then the text.
    let mut len = 0usize;
    // SAFETY: a live handle; the size query (NULL, 0) and a writable length.
    let rc = unsafe { kvferry_agent_metrics(agent, null_mut(), 0, &mut len) };
    assert_eq!(rc, status(KVFERRY_OK));
    let mut text = vec![0u8; len + 1];
    // SAFETY: a live handle and a buffer of `len` bytes (no room for the NUL).
    let rc = unsafe { kvferry_agent_metrics(agent, text.as_mut_ptr().cast(), len, &mut len) };
    assert_eq!(rc, status(KVFERRY_ERR_BUFFER_TOO_SMALL));
    // SAFETY: a live handle and a buffer of `len + 1` bytes.
    let rc = unsafe { kvferry_agent_metrics(agent, text.as_mut_ptr().cast(), len + 1, &mut len) };
    assert_eq!(rc, status(KVFERRY_OK));
    assert_eq!(text[len], 0);
    let text = String::from_utf8(text[..len].to_vec()).unwrap();
    let labels = r#"kvferry_instance="context-t",rank="0",role="prefill""#;
    for line in [
        format!("kvferry_requests_in_flight{{{labels}}} 2"),
        format!(r#"kvferry_requests_total{{{labels},outcome="sent"}} 0"#),
        format!("kvferry_transfer_duration_seconds_count{{{labels}}} 0"),
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
    }
    // Which kvferry (and UCX, and planner) made them.
    let build = format!(
        r#"kvferry_build_info{{version="{}",ucx=""#,
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.lines().any(|l| l.starts_with(&build)), "{text}");
    // SAFETY: a live handle, destroyed once.
    unsafe { kvferry_agent_destroy(agent) };
}
