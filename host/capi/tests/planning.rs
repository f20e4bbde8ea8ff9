//! Plans without an agent, through the C entry points (`kvferry_pair_planner_*`,
//! `kvferry_plan_*`): a TP-2 prefill instance and a TP-1 decode rank with Llama-3-70B's KV
//! geometry (8 KV heads of 128, bf16; two of its 80 layers, 16-token blocks). Each prefill
//! rank's plan is expanded and executed by plain copies, as another transfer layer would, and
//! the oracle checks every destination byte and that nothing else changed; the pattern form
//! expands to the same fragments. Refusals name what is wrong.

mod support;

use std::ffi::{CStr, CString, c_char, c_int};
use std::ptr::{null, null_mut};

use ::kvferry_plan::RequestSide;
use kvferry_capi::kvferry_status::*;
use kvferry_capi::*;
use kvferry_planner_abi::{PairRequest, SlotTable};
use kvferry_testkit::oracle::{Delivery, LocalMemory, Oracle, PoolMemory};

/// Bytes of one head's 16-token block (128 dims of bf16).
const HEAD_BLOCK: u64 = 16 * 128 * 2;
const SLOTS: u64 = 4;
const LAYERS: u64 = 2;

fn last_error() -> String {
    // SAFETY: a NULL buffer with cap 0 asks for the length only.
    let len = unsafe { kvferry_last_error(null_mut(), 0) };
    let mut buf = vec![0 as c_char; len + 1];
    // SAFETY: `buf` has `len + 1` writable bytes.
    unsafe { kvferry_last_error(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by kvferry_last_error.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Bytes of one slot of a rank holding `8 / tp` of the heads: K and V per layer.
fn slot_bytes(tp: u64) -> u64 {
    LAYERS * 2 * (8 / tp) * HEAD_BLOCK
}

/// The configuration of rank `rank` of a TP-`tp` instance whose one pool is at `base`.
fn config(role: &str, instance: &str, tp: u64, rank: u64, base: u64, plugins: &str) -> String {
    let buffer = (8 / tp) * HEAD_BLOCK;
    let entries: Vec<String> = (0..LAYERS)
        .flat_map(|l| {
            (0..2).map(move |kv| {
                format!(
                    r#"{{"local_layer": {l}, "offset": {}, "size": {buffer}}}"#,
                    (l * 2 + kv) * buffer
                )
            })
        })
        .collect();
    let layers: Vec<String> = (0..LAYERS)
        .map(|l| format!(r#"{{"local": {l}, "global": {l}}}"#))
        .collect();
    format!(
        r#"{{"version": 1, "instance": "{instance}", "role": "{role}",
            "architecture": "LlamaForCausalLM", "planner": "kvferry.default",
            "plugin_dir": "{plugins}",
            "rank": {{"mapping": "tp{tp}", "instance_rank": {rank}, "layers_per_pp": [{LAYERS}],
              "page_table": {{"tokens_per_block": 16,
                "pools": [{{"base": {base}, "slot_bytes": {slot}, "num_slots": {SLOTS}}}],
                "groups": [{{"layers": [{layers}],
                  "views": [{{"pool": 0, "roles": ["key", "value"], "entries": [{entries}],
                    "layout": {{"kind": "hnd", "dtype": "bf16", "elem_bits": 16,
                                "num_shards": {tp}, "shard_index": {rank},
                                "shard_unit_bytes": {HEAD_BLOCK}}}}}]}}]}}}}}}"#,
        slot = slot_bytes(tp),
        layers = layers.join(", "),
        entries = entries.join(", "),
    )
}

fn new_planner(prefill: &str, decode: &str) -> Result<*mut kvferry_pair_planner, (c_int, String)> {
    let (prefill, decode) = (
        CString::new(prefill).unwrap(),
        CString::new(decode).unwrap(),
    );
    let mut out = null_mut();
    // SAFETY: NUL-terminated strings and a writable out pointer.
    let status = unsafe { kvferry_pair_planner_new(prefill.as_ptr(), decode.as_ptr(), &mut out) };
    if status == KVFERRY_OK as c_int {
        assert!(!out.is_null());
        Ok(out)
    } else {
        assert!(out.is_null());
        Err((status, last_error()))
    }
}

fn table(slots: &[i32]) -> SlotTable {
    SlotTable::new(slots.iter().map(|&s| i64::from(s)))
}

fn c_tables(tables: &[Vec<i32>]) -> Vec<kvferry_slot_table> {
    tables
        .iter()
        .map(|t| kvferry_slot_table {
            slots: t.as_ptr(),
            len: t.len(),
        })
        .collect()
}

/// Plans tokens `0..prompt_len` from `prefill` slots to `decode` slots.
fn plan(
    planner: *const kvferry_pair_planner,
    prefill: &[Vec<i32>],
    decode: &[Vec<i32>],
    prompt_len: u64,
) -> Result<*mut kvferry_plan, (c_int, String)> {
    let (p, d) = (c_tables(prefill), c_tables(decode));
    let mut out = null_mut();
    // SAFETY: a live planner; the tables outlive the call; no views.
    let status = unsafe {
        kvferry_pair_planner_plan(
            planner,
            p.as_ptr(),
            p.len(),
            d.as_ptr(),
            d.len(),
            0,
            prompt_len,
            prompt_len,
            u64::MAX,
            null(),
            0,
            &mut out,
        )
    };
    if status == KVFERRY_OK as c_int {
        Ok(out)
    } else {
        assert!(out.is_null());
        Err((status, last_error()))
    }
}

/// `kvferry_plan_expand` into three arrays, claiming room for `cap` entries in each.
fn expand_into(
    plan: *const kvferry_plan,
    arrays: [&mut Vec<u64>; 3],
    cap: usize,
    n: &mut usize,
) -> c_int {
    let [src, dst, len] = arrays;
    assert!([src.len(), dst.len(), len.len()].iter().all(|&l| l >= cap));
    // SAFETY: a live plan; each array has room for at least `cap` entries.
    unsafe {
        kvferry_plan_expand(
            plan,
            src.as_mut_ptr(),
            dst.as_mut_ptr(),
            len.as_mut_ptr(),
            cap,
            n,
        )
    }
}

/// The plan's fragments as `kvferry_plan_expand` gives them.
fn expand(plan: *const kvferry_plan) -> Vec<(u64, u64, u64)> {
    let mut n = 0;
    // SAFETY: a size query on a live plan.
    let status =
        unsafe { kvferry_plan_expand(plan, null_mut(), null_mut(), null_mut(), 0, &mut n) };
    assert_eq!(status, KVFERRY_OK as c_int);
    let (mut src, mut dst, mut len) = (vec![0u64; n], vec![0u64; n], vec![0u64; n]);
    if n > 0 {
        let mut short = 0;
        // Room for n - 1 entries: refused, nothing written.
        let status = expand_into(plan, [&mut src, &mut dst, &mut len], n - 1, &mut short);
        assert_eq!(status, KVFERRY_ERR_BUFFER_TOO_SMALL as c_int);
        assert_eq!(short, n);
        assert!(src.iter().all(|&a| a == 0));
    }
    let status = expand_into(plan, [&mut src, &mut dst, &mut len], n, &mut n);
    assert_eq!(status, KVFERRY_OK as c_int);
    (0..n).map(|k| (src[k], dst[k], len[k])).collect()
}

/// The plan's fragments from its patterns (`kvferry_plan_get_pattern`), expanded by hand.
fn from_patterns(plan: *const kvferry_plan) -> (Vec<(u64, u64, u64)>, u64) {
    let (mut patterns, mut fragments, mut bytes) = (0, 0, 0);
    // SAFETY: a live plan and writable outputs.
    let status = unsafe { kvferry_plan_size(plan, &mut patterns, &mut fragments, &mut bytes) };
    assert_eq!(status, KVFERRY_OK as c_int);
    let mut out = Vec::new();
    for i in 0..patterns {
        let mut p = std::mem::MaybeUninit::<kvferry_plan_pattern>::uninit();
        // SAFETY: a live plan and a writable pattern.
        let status = unsafe { kvferry_plan_get_pattern(plan, i, p.as_mut_ptr()) };
        assert_eq!(status, KVFERRY_OK as c_int);
        // SAFETY: written by the call.
        let p = unsafe { p.assume_init() };
        // SAFETY: the plan's arrays, alive while the plan is, with these lengths.
        let (so, dof, ln, sr, dr) = unsafe {
            (
                std::slice::from_raw_parts(p.src_offsets, p.n_fragments),
                std::slice::from_raw_parts(p.dst_offsets, p.n_fragments),
                std::slice::from_raw_parts(p.lengths, p.n_fragments),
                std::slice::from_raw_parts(p.src_rows, p.n_rows),
                std::slice::from_raw_parts(p.dst_rows, p.n_rows),
            )
        };
        for r in 0..p.n_rows {
            for k in 0..p.n_fragments {
                out.push((sr[r] + so[k], dr[r] + dof[k], ln[k]));
            }
        }
    }
    let mut past = std::mem::MaybeUninit::<kvferry_plan_pattern>::uninit();
    // SAFETY: as above; an index past the last pattern is refused.
    let status = unsafe { kvferry_plan_get_pattern(plan, patterns, past.as_mut_ptr()) };
    assert_eq!(status, KVFERRY_ERR_INVALID_ARGUMENT as c_int);
    assert_eq!(out.len(), fragments);
    (out, bytes)
}

#[test]
fn a_tp2_to_tp1_plan_executed_by_copies_delivers_every_byte() {
    let plugins = support::plugin_dir();
    let dir = support::json_path(plugins.path());
    let mut memory = LocalMemory::new();
    let decode_base = memory.allocate(SLOTS * slot_bytes(1), "decode pool");
    let prefill_bases = [
        memory.allocate(SLOTS * slot_bytes(2), "prefill rank 0 pool"),
        memory.allocate(SLOTS * slot_bytes(2), "prefill rank 1 pool"),
    ];
    let decode = config("generation", "decode", 1, 0, decode_base, &dir);
    // A 20-token prompt: two blocks, the second partly filled.
    let prompt_len = 20;
    let decode_tables = vec![vec![3, 1]];
    let prefill_tables = [vec![vec![2, 0]], vec![vec![1, 3]]];

    let mut planners = Vec::new();
    for r in 0..2 {
        let prefill = config("context", "prefill", 2, r, prefill_bases[r as usize], &dir);
        let planner = new_planner(&prefill, &decode).expect("the pair planner starts");
        let mut writes = false;
        // SAFETY: a live planner and a writable bool.
        let status = unsafe { kvferry_pair_planner_writes(planner, &mut writes) };
        assert_eq!(status, KVFERRY_OK as c_int);
        assert!(
            writes,
            "prefill rank {r} writes its heads into the decode rank"
        );
        planners.push(planner);
    }

    // The sides' descriptions as the planners built them (blobs included), from the Rust
    // face of the same planner (the C handle is opaque), for the oracle.
    let descriptions: Vec<_> = (0..2)
        .map(|r| {
            let prefill = config("context", "prefill", 2, r, prefill_bases[r as usize], &dir);
            kvferry::planning::PairPlanner::new(&prefill, &decode).unwrap()
        })
        .collect();
    let oracle = Oracle::new(7);
    for (r, d) in descriptions.iter().enumerate() {
        let tables: Vec<SlotTable> = prefill_tables[r].iter().map(|t| table(t)).collect();
        oracle
            .fill_source(&mut memory, RequestSide::new(d.prefill(), &tables))
            .unwrap();
    }
    oracle
        .prime_destination(&mut memory, descriptions[0].decode())
        .unwrap();

    let mut moved = 0;
    for (r, &planner) in planners.iter().enumerate() {
        let plan = plan(planner, &prefill_tables[r], &decode_tables, prompt_len).unwrap();
        let fragments = expand(plan);
        let (patterned, bytes) = from_patterns(plan);
        assert_eq!(fragments, patterned, "the patterns expand to the flat form");
        assert_eq!(bytes, fragments.iter().map(|f| f.2).sum::<u64>());
        for &(src, dst, len) in &fragments {
            let mut buf = vec![0; len as usize];
            memory.read(src, &mut buf).unwrap();
            memory.bytes_mut(dst, len).unwrap().copy_from_slice(&buf);
        }
        moved += bytes;
        // SAFETY: a live plan, destroyed once.
        unsafe { kvferry_plan_destroy(plan) };
    }
    // Every head of both layers, K and V, for the 20 tokens of the two blocks (rows are whole
    // blocks: the partial block moves whole).
    assert_eq!(moved, 2 * LAYERS * 2 * 8 * HEAD_BLOCK);

    let prefill_t: Vec<Vec<SlotTable>> = prefill_tables
        .iter()
        .map(|ts| ts.iter().map(|t| table(t)).collect())
        .collect();
    let decode_t: Vec<SlotTable> = decode_tables.iter().map(|t| table(t)).collect();
    let context = [
        RequestSide::new(descriptions[0].prefill(), &prefill_t[0]),
        RequestSide::new(descriptions[1].prefill(), &prefill_t[1]),
    ];
    let receivers = [RequestSide::new(descriptions[0].decode(), &decode_t)];
    let pieces = [PairRequest::whole(prompt_len)];
    let report = oracle
        .verify(
            &memory,
            &Delivery {
                prefill: &context,
                receivers: &receivers,
                pieces: &pieces,
            },
        )
        .unwrap();
    assert!(report.is_clean(), "{report}");
    for planner in planners {
        // SAFETY: a live planner, destroyed once.
        unsafe { kvferry_pair_planner_destroy(planner) };
    }
}

#[test]
fn refusals_name_what_is_wrong() {
    let plugins = support::plugin_dir();
    let dir = support::json_path(plugins.path());
    let (prefill, decode) = (
        config("context", "prefill", 2, 0, 1 << 30, &dir),
        config("generation", "decode", 1, 0, 1 << 32, &dir),
    );

    // The roles swapped.
    let (status, text) = new_planner(&decode, &prefill).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_INVALID_REQUEST as c_int);
    assert!(
        text.contains("prefill configuration's role is decode"),
        "{text}"
    );
    // Not a configuration.
    let (status, text) = new_planner("{}", &decode).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_CONFIG as c_int);
    assert!(
        text.contains("prefill configuration: config has no \"version\""),
        "{text}"
    );
    // A planner no directory holds.
    let unknown = decode.replace("kvferry.default", "kvferry.nonexistent");
    let (status, text) = new_planner(&prefill, &unknown).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_PLANNER as c_int);
    assert!(
        text.contains("decode configuration") && text.contains("kvferry.nonexistent"),
        "{text}"
    );

    let planner = new_planner(&prefill, &decode).unwrap();
    // One table too many on the decode side.
    let (status, text) = plan(planner, &[vec![0]], &[vec![0], vec![1]], 16).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_INVALID_REQUEST as c_int);
    assert!(
        text.contains("the decode side: 2 slot table(s) for 1 layer group(s)"),
        "{text}"
    );
    // A slot past the pool's four.
    let (status, text) = plan(planner, &[vec![4]], &[vec![0]], 16).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_INVALID_REQUEST as c_int);
    assert!(
        text.contains("the prefill side") && text.contains("slot 4"),
        "{text}"
    );
    // Tables short of the tokens (two entries for 40 tokens of 16-token blocks
    // planned 32 tokens as if whole), on either side, and a slot named twice.
    for (p, d, side) in [
        (vec![0, 1], vec![0, 1, 2], "the prefill side"),
        (vec![0, 1, 2], vec![0, 1], "the decode side"),
    ] {
        let (status, text) = plan(planner, &[p], &[d], 40).unwrap_err();
        assert_eq!(status, KVFERRY_ERR_INVALID_REQUEST as c_int);
        assert!(
            text.contains(side)
                && text.contains("2 entries of 16 tokens")
                && text.contains("run to 40"),
            "{text}"
        );
    }
    let (status, text) = plan(planner, &[vec![0, 1, 2]], &[vec![3, 1, 3]], 40).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_INVALID_REQUEST as c_int);
    assert!(
        text.contains("slot 3 is named for blocks 0 and 2"),
        "{text}"
    );
    // Tokens past the prompt (the plan call takes 0..prompt_len; a zero-token prompt).
    let (status, text) = plan(planner, &[vec![0]], &[vec![0]], 0).unwrap_err();
    assert_eq!(status, KVFERRY_ERR_INVALID_REQUEST as c_int);
    assert!(text.contains("tokens 0..0 of a 0-token prompt"), "{text}");
    // NULL handles.
    let mut out = null_mut();
    // SAFETY: a NULL planner is refused before anything is read.
    let status = unsafe {
        kvferry_pair_planner_plan(
            null(),
            null(),
            0,
            null(),
            0,
            0,
            1,
            1,
            u64::MAX,
            null(),
            0,
            &mut out,
        )
    };
    assert_eq!(status, KVFERRY_ERR_NULL_POINTER as c_int);
    // SAFETY: a live planner, destroyed once; NULL is ignored.
    unsafe {
        kvferry_pair_planner_destroy(planner);
        kvferry_pair_planner_destroy(null_mut());
        kvferry_plan_destroy(null_mut());
    }
}
