//! What verification found: the logical identity of a byte, mismatches and the report.

use std::fmt;

/// Which side of the transfer a checked byte is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// A sender (context) pool.
    Source,
    /// A receiver (generation) pool.
    Destination,
}

/// The logical identity of a byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Logical {
    /// A byte of a PAGED view.
    Token {
        /// Global layer.
        layer: u32,
        /// The view's roles, comma-separated.
        roles: String,
        /// Buffer index inside the layer (K = 0, V = 1).
        buffer: u32,
        /// Global head.
        head: u64,
        /// Token position in the prompt.
        token: u64,
        /// Byte within the head's row of that token.
        byte: u64,
    },
    /// A byte of a STATE head (or a replicated state buffer).
    State {
        /// Global layer.
        layer: u32,
        /// The view's roles.
        roles: String,
        /// Buffer index inside the layer.
        buffer: u32,
        /// Global head.
        head: u64,
        /// Byte within the head.
        byte: u64,
    },
    /// A byte of a STATE section.
    Section {
        /// Global layer.
        layer: u32,
        /// The view's roles.
        roles: String,
        /// Section index.
        section: u32,
        /// Offset in the whole model's section.
        byte: u64,
    },
    /// A destination byte the request does not cover (expected: canary).
    Uncovered {
        /// The slot it lies in.
        slot: u64,
        /// Whether it is slot padding.
        padding: bool,
    },
    /// A source byte outside the request (expected: the foreign pattern).
    Foreign {
        /// The slot it lies in.
        slot: u64,
        /// Whether it is slot padding.
        padding: bool,
    },
}

impl fmt::Display for Logical {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Logical::Token {
                layer,
                roles,
                buffer,
                head,
                token,
                byte,
            } => write!(
                f,
                "layer {layer} {{{roles}}} buffer {buffer} head {head} token {token} byte {byte}"
            ),
            Logical::State {
                layer,
                roles,
                buffer,
                head,
                byte,
            } => write!(
                f,
                "state layer {layer} {{{roles}}} buffer {buffer} head {head} byte {byte}"
            ),
            Logical::Section {
                layer,
                roles,
                section,
                byte,
            } => write!(
                f,
                "state layer {layer} {{{roles}}} section {section} byte {byte}"
            ),
            Logical::Uncovered { slot, padding } => {
                let what = if *padding { "padding of" } else { "uncovered" };
                write!(f, "{what} slot {slot} (canary)")
            }
            Logical::Foreign { slot, padding } => {
                let what = if *padding {
                    "padding of"
                } else {
                    "unrequested"
                };
                write!(f, "{what} slot {slot} (foreign)")
            }
        }
    }
}

/// One byte that differs from what the oracle expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Sender or receiver pool.
    pub side: Side,
    /// Instance of the rank.
    pub instance: String,
    /// The rank.
    pub rank: u32,
    /// Pool index in the rank's page table.
    pub pool: u32,
    /// Offset from the pool's base.
    pub offset: u64,
    /// What the byte stands for.
    pub logical: Logical,
    /// The expected value.
    pub expected: u8,
    /// The value found.
    pub found: u8,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = match self.side {
            Side::Source => "source",
            Side::Destination => "destination",
        };
        write!(
            f,
            "{side} {} rank {} pool {} offset {:#x} ({}): expected {:#04x}, found {:#04x}",
            self.instance,
            self.rank,
            self.pool,
            self.offset,
            self.logical,
            self.expected,
            self.found
        )
    }
}

/// What [`Oracle::verify`](super::Oracle::verify) found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Receiver pool bytes checked (every byte of every receiver pool).
    pub bytes_checked: u64,
    /// Of those, bytes the request covers.
    pub bytes_covered: u64,
    /// Sender pool bytes checked.
    pub source_bytes_checked: u64,
    /// Bytes that differ, on both sides.
    pub mismatched_bytes: u64,
    /// The first mismatches, in check order (receivers first).
    pub mismatches: Vec<Mismatch>,
}

impl VerifyReport {
    /// Whether every byte matched.
    pub fn is_clean(&self) -> bool {
        self.mismatched_bytes == 0
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} destination bytes checked ({} covered), {} source bytes checked: ",
            self.bytes_checked,
            crate::units::size(self.bytes_covered),
            self.source_bytes_checked
        )?;
        if self.is_clean() {
            return f.write_str("all match");
        }
        write!(f, "{} bytes differ", self.mismatched_bytes)?;
        for m in &self.mismatches {
            write!(f, "\n  {m}")?;
        }
        if (self.mismatches.len() as u64) < self.mismatched_bytes {
            write!(
                f,
                "\n  ... and {} more",
                self.mismatched_bytes - self.mismatches.len() as u64
            )?;
        }
        Ok(())
    }
}
