//! The transceiver: moves a request's KV cache between two processes with UCX RMA writes.
//!
//! ```text
//!  controller ──Submit──► context server                      generation server ◄──Submit── controller
//!                          │ prefill: slots + oracle tags        │ slots + canary, targets()
//!                          │                    ◄──RequestData───┤ one per (receiver, target)
//!                          │ plan_transfer per piece             │
//!                          │ rank thread: put × n, flush ═══════►│ (UCX RMA into its pools)
//!                          │                    ───Completion───►│ after the flush
//!                          │                                     │ all is_last Ok ─Done─► controller
//! ```
//!
//! - [`wire`]: the versioned, size-limited frames and every message.
//! - [`instance`]: one process holding every rank of an instance: UCX context, pools in host
//!   or CUDA memory ([`memory`]), planners, one progress thread per rank ([`rank`]).
//! - [`sender`] / [`receiver`]: the two sides of the protocol; [`server`] runs either behind
//!   a TCP listener; [`client`] drives one.
//! - [`slots`]: per-DP-group slot allocation; [`verify`]: the oracle on UCX pools.

pub mod client;
pub mod conn;
pub mod instance;
pub mod memory;
pub mod rank;
pub mod receiver;
pub mod sender;
pub mod server;
pub mod slots;
pub mod verify;
pub mod wire;

use kvferry_planner_abi::{Mapping, PairRequest, TokenRange};

use kvferry_testkit::layout::ModelSpec;
use kvferry_testkit::scenario::Scenario;

pub use client::{Client, ClientError};
pub use instance::{Instance, InstanceConfig, PreparedInstance, Transport};
pub use memory::MemoryKind;
pub use server::{Running, ServeError, ServeOptions, start};
pub use wire::{Message, Role};

/// What a connection handler does after a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Read the next message.
    Continue,
    /// Close the connection quietly.
    Close,
    /// Send [`Message::Error`] with this reason, then close.
    Refuse(String),
    /// Exit the process.
    Exit,
}

/// The pieces a sender plans for a request of `prompt_len` tokens: the whole prompt, or the
/// given block-aligned chunks (the last with `is_last`).
///
/// # Errors
///
/// A zero prompt, or chunks that are empty, out of order, overlapping, past the prompt or
/// not aligned to blocks.
pub fn request_pieces(
    model: &ModelSpec,
    prompt_len: u64,
    chunks: Option<Vec<TokenRange>>,
) -> Result<Vec<PairRequest>, String> {
    if prompt_len == 0 {
        return Err("prompt_len is 0".into());
    }
    let single = Mapping {
        tp: 1,
        pp: 1,
        cp: 1,
        moe_tp: 1,
        moe_ep: 1,
        attention_dp: false,
    };
    let mut scenario = Scenario::new(model.clone(), single, single, prompt_len);
    scenario.chunks = chunks;
    scenario.pieces().map_err(|e| e.to_string())
}

/// Block-aligned chunks of `chunk` tokens covering `prompt_len` tokens.
pub fn chunk_ranges(prompt_len: u64, chunk: u64) -> Vec<TokenRange> {
    (0..prompt_len)
        .step_by(chunk.max(1) as usize)
        .map(|start| TokenRange {
            start,
            end: (start + chunk).min(prompt_len),
        })
        .collect()
}
