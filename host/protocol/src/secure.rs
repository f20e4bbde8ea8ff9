//! The secure channel every kvferry connection runs in: a Noise handshake keyed by the
//! deployment's [`Secret`], then encrypted, authenticated records that carry the frames.
//!
//! The handshake is the Noise framework's `NNpsk0` pattern
//! ([`NOISE_PARAMS`]: X25519, ChaCha20-Poly1305, SHA-256) with a pre-shared key derived from
//! the secret, implemented by the `snow` crate:
//!
//! ```text
//! dialer                                              acceptor
//!   preamble(magic, version, len) ‖ -> psk, e, {intent} ─▶  tries each accepted key
//!                              ◀── len ‖ <- e, ee        (len 0: no key opened it)
//!   records ‖ nonce-counted, ChaCha20-Poly1305 ─────────▶ the first that opens proves the dialer
//! ```
//!
//! What it binds: the handshake hash covers the protocol name, a prologue naming the message
//! family and [`PROTOCOL_VERSION`], the pre-shared key and both sides' ephemeral keys; every
//! record after it is encrypted under keys derived from that hash, with a per-direction
//! counter as the nonce. A relay that forwards the two handshake messages between two honest
//! agents ends up with neither key: it can pass the records on unread or drop them, never read,
//! alter, reorder, replay or inject one. The dialer's first message carries, encrypted under
//! the secret, the endpoint it meant to reach ([`Intent`]), which the acceptor checks against
//! its own. The acceptor knows the dialer holds the secret once the first record opens (a
//! replayed first message opens no record); the dialer knows the acceptor holds it once the
//! reply opens. Before either, a peer can make this side read at most [`MAX_HELLO`] bytes
//! plus one record ([`MAX_RECORD`]).
//!
//! Who holding the secret can still do harm: any holder can impersonate any rank of the
//! deployment (there are no per-rank keys), so the secret is exactly as strong as the least
//! careful host that stores it.

use std::fmt;
use std::io::{self, Read, Write};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use snow::{HandshakeState, StatelessTransportState};

use crate::{Frame, PROTOCOL_VERSION, WireError, read_start};

/// The Noise protocol: pattern `NNpsk0`, X25519, ChaCha20-Poly1305, SHA-256.
pub const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_SHA256";
/// The shortest shared secret accepted.
pub const MIN_SECRET_LEN: usize = 16;
/// The most bytes a handshake message may have (either direction).
pub const MAX_HELLO: usize = 1024;
/// The most bytes of one record on the wire (Noise's message limit).
pub const MAX_RECORD: usize = 65535;
/// Bytes of the authentication tag of each record.
const TAG_LEN: usize = 16;
/// The most plaintext bytes one record carries.
pub const MAX_RECORD_PLAINTEXT: usize = MAX_RECORD - TAG_LEN;
/// Bytes of the dialer's preamble: the family's magic, the protocol version, the length of
/// the first handshake message.
pub const PREAMBLE_LEN: usize = 8;
/// The longest endpoint an [`Intent`] may name.
pub const MAX_INTENT_ENDPOINT: usize = 255;

/// A deployment's shared secret: every agent (and controller) of a deployment holds it.
///
/// Its bytes never appear in `Debug` output or on the wire; the handshake uses a key
/// derived from them. During a change of secret, [`Secret::also_accepting`] lets an acceptor
/// take dialers that still use the previous one.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    key: Vec<u8>,
    /// Further secrets an acceptor accepts (the previous secret during a rotation).
    also: Vec<Vec<u8>>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str("Secret(none)")
        } else {
            write!(f, "Secret({} bytes, redacted", self.key.len())?;
            if !self.also.is_empty() {
                write!(f, ", {} more accepted", self.also.len())?;
            }
            f.write_str(")")
        }
    }
}

/// Why a secret was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Too short.
    #[error("a shared secret must be at least {MIN_SECRET_LEN} bytes; this one has {len}")]
    Short {
        /// Its length.
        len: usize,
    },
    /// Nothing but whitespace: a file or variable that was meant to hold a secret and does
    /// not.
    #[error("the shared secret is {len} bytes of whitespace only")]
    Blank {
        /// Its length.
        len: usize,
    },
}

impl Secret {
    /// A secret of at least [`MIN_SECRET_LEN`] bytes, not all whitespace.
    ///
    /// # Errors
    ///
    /// A shorter or blank one.
    pub fn new(key: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        let key = key.into();
        if key.len() < MIN_SECRET_LEN {
            return Err(SecretError::Short { len: key.len() });
        }
        if key.iter().all(u8::is_ascii_whitespace) {
            return Err(SecretError::Blank { len: key.len() });
        }
        Ok(Self {
            key,
            also: Vec::new(),
        })
    }

    /// No secret: peers are not authenticated (the channel is still encrypted, under a key
    /// anyone can derive). Two agents without a secret accept each other; an agent without
    /// one and an agent with one refuse each other. For tests and single-user machines only —
    /// any local process can then drive the agent.
    pub fn unauthenticated() -> Self {
        Self {
            key: Vec::new(),
            also: Vec::new(),
        }
    }

    /// Whether this is [`Secret::unauthenticated`].
    pub fn is_unauthenticated(&self) -> bool {
        self.key.is_empty()
    }

    /// This secret, dialing with itself, and accepting dialers that prove `previous` too:
    /// the middle step of a rotation: first every agent also accepts the new secret, then
    /// every agent dials with it (still accepting the old), then the old one is dropped.
    #[must_use]
    pub fn also_accepting(mut self, previous: Secret) -> Self {
        if previous.key != self.key && !self.also.contains(&previous.key) {
            self.also.push(previous.key);
        }
        self
    }

    /// The pre-shared key a dialer uses.
    fn psk(&self) -> [u8; 32] {
        psk(&self.key)
    }

    /// The pre-shared keys an acceptor tries, this secret's first.
    fn accepted(&self) -> impl Iterator<Item = [u8; 32]> + '_ {
        std::iter::once(&self.key).chain(&self.also).map(|k| psk(k))
    }
}

/// The Noise pre-shared key of a secret: SHA-256 under a label, so the 32 bytes Noise needs
/// come from a secret of any length, and the secret itself is used nowhere else.
fn psk(key: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"kvferry pre-shared key v1\0");
    h.update(key);
    h.finalize().into()
}

/// The prologue both sides mix into the handshake: the family and version, so a handshake
/// of one message family or version cannot complete as another.
fn prologue<M: Frame>() -> Vec<u8> {
    let mut p = b"kvferry\0".to_vec();
    p.extend_from_slice(&M::MAGIC);
    p.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    p
}

/// What the dialer meant to reach, sent encrypted in its first message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    /// The endpoint dialed (`host:port`, as the dialer was given it).
    pub endpoint: String,
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Reading or writing the socket failed, or the peer closed it, or a deadline passed.
    #[error("handshake i/o")]
    Io(#[from] io::Error),
    /// The first bytes are not a kvferry handshake of this family and version.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A handshake message longer than [`MAX_HELLO`].
    #[error("handshake message of {len} bytes exceeds the {MAX_HELLO}-byte limit")]
    Oversized {
        /// The length claimed.
        len: usize,
    },
    /// The peer's handshake message does not open under this side's secret: it does not
    /// hold the deployment's secret (or holds one where this side has none, or the reverse).
    #[error(
        "the peer did not prove the shared secret (a different secret, or one side has none: \
         check KVFERRY_SECRET, the configuration's `secret` or `secret_hex`, or \
         `--secret-file`, on both sides)"
    )]
    Unauthenticated,
    /// The acceptor could not open the dialer's first message (it holds another secret).
    #[error(
        "the peer refused this side's proof of the shared secret (a different secret, or one \
         side has none: check KVFERRY_SECRET, the configuration's `secret` or `secret_hex`, \
         or `--secret-file`, on both sides)"
    )]
    Refused,
    /// The dialer's intent does not decode, or is too long.
    #[error("the dialer's intent is malformed: {0}")]
    Intent(String),
    /// Noise refused a step it should not refuse (a bug, not the peer's input).
    #[error("noise: {0}")]
    Noise(String),
}

/// An established channel: the keys of both directions and the handshake's hash.
pub struct Channel {
    state: Arc<StatelessTransportState>,
    hash: [u8; 32],
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel").finish_non_exhaustive()
    }
}

impl Channel {
    fn finish(hs: HandshakeState) -> Result<Self, HandshakeError> {
        let mut hash = [0u8; 32];
        hash.copy_from_slice(hs.get_handshake_hash());
        let state = hs
            .into_stateless_transport_mode()
            .map_err(|e| HandshakeError::Noise(e.to_string()))?;
        Ok(Self {
            state: Arc::new(state),
            hash,
        })
    }

    /// The handshake hash: unique to this session, known to its two ends alone. Binds
    /// anything else that must be tied to this session (a UCX worker's proof).
    pub fn binding(&self) -> [u8; 32] {
        self.hash
    }

    /// The reading and writing halves over `reader` and `writer` (two handles of one
    /// connection).
    pub fn split<R: Read, W: Write>(
        self,
        reader: R,
        writer: W,
    ) -> (SecureReader<R>, SecureWriter<W>) {
        (
            SecureReader {
                inner: reader,
                state: Arc::clone(&self.state),
                nonce: 0,
                record: Vec::new(),
                plain: Vec::new(),
                pos: 0,
            },
            SecureWriter {
                inner: writer,
                state: self.state,
                nonce: 0,
                pending: Vec::new(),
                out: Vec::new(),
            },
        )
    }
}

fn noise<T>(r: Result<T, snow::Error>) -> Result<T, HandshakeError> {
    r.map_err(|e| HandshakeError::Noise(e.to_string()))
}

fn handshake_state(
    psk: &[u8; 32],
    prologue: &[u8],
    initiator: bool,
) -> Result<HandshakeState, HandshakeError> {
    let params = noise(NOISE_PARAMS.parse())?;
    let builder = noise(
        snow::Builder::new(params)
            .psk(0, psk)
            .and_then(|b| b.prologue(prologue)),
    )?;
    noise(if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    })
}

/// Dials: sends the first handshake message with `intent`, checks the acceptor's reply, and
/// returns the channel. `stream` is the connection, read and written during the call only.
///
/// # Errors
///
/// See [`HandshakeError`]; [`HandshakeError::Refused`] when the acceptor holds another
/// secret, [`HandshakeError::Unauthenticated`] when its reply does not open.
pub fn dial<M: Frame>(
    stream: &mut (impl Read + Write),
    secret: &Secret,
    intent: &Intent,
) -> Result<Channel, HandshakeError> {
    if intent.endpoint.len() > MAX_INTENT_ENDPOINT {
        return Err(HandshakeError::Intent(format!(
            "endpoint of {} bytes (at most {MAX_INTENT_ENDPOINT})",
            intent.endpoint.len()
        )));
    }
    let psk = secret.psk();
    let prologue = prologue::<M>();
    let mut hs = handshake_state(&psk, &prologue, true)?;
    let payload = bincode::serde::encode_to_vec(intent, bincode::config::standard())
        .map_err(|e| HandshakeError::Intent(e.to_string()))?;
    let mut msg = [0u8; MAX_HELLO];
    let len = noise(hs.write_message(&payload, &mut msg))?;
    let mut first = Vec::with_capacity(PREAMBLE_LEN + len);
    first.extend_from_slice(&M::MAGIC);
    first.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    first.extend_from_slice(&(len as u16).to_le_bytes());
    first.extend_from_slice(&msg[..len]);
    stream.write_all(&first)?;
    stream.flush()?;
    let mut l = [0u8; 2];
    read_exactly(stream, &mut l, "the acceptor's reply")?;
    let reply_len = usize::from(u16::from_le_bytes(l));
    if reply_len == 0 {
        return Err(HandshakeError::Refused);
    }
    if reply_len > MAX_HELLO {
        return Err(HandshakeError::Oversized { len: reply_len });
    }
    let mut reply = vec![0u8; reply_len];
    read_exactly(stream, &mut reply, "the acceptor's reply")?;
    let mut payload = [0u8; MAX_HELLO];
    hs.read_message(&reply, &mut payload)
        .map_err(|_| HandshakeError::Unauthenticated)?;
    Channel::finish(hs)
}

/// Accepts: reads the dialer's first message, opens it under one of the secrets this side
/// accepts, answers, and returns the channel and what the dialer meant to reach. A message
/// that opens under none is answered with an empty reply (the dialer learns only that) and
/// is [`HandshakeError::Unauthenticated`].
///
/// The dialer is proven only once the channel's first record opens (a replayed first
/// message opens none): read its first frame before trusting or answering anything.
///
/// # Errors
///
/// See [`HandshakeError`].
pub fn accept<M: Frame>(
    stream: &mut (impl Read + Write),
    secret: &Secret,
) -> Result<(Channel, Intent), HandshakeError> {
    let mut pre = [0u8; PREAMBLE_LEN];
    if !read_start(stream, &mut pre, "handshake preamble")? {
        return Err(WireError::Closed.into());
    }
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&pre[..4]);
    if magic != M::MAGIC {
        return Err(WireError::BadMagic {
            found: magic,
            expected: M::MAGIC,
            family: M::FAMILY,
        }
        .into());
    }
    let version = u16::from_le_bytes([pre[4], pre[5]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::Version { found: version }.into());
    }
    let len = usize::from(u16::from_le_bytes([pre[6], pre[7]]));
    if len > MAX_HELLO {
        return Err(HandshakeError::Oversized { len });
    }
    let mut first = vec![0u8; len];
    read_exactly(stream, &mut first, "the dialer's first message")?;
    let prologue = prologue::<M>();
    let mut payload = [0u8; MAX_HELLO];
    let mut opened = None;
    for psk in secret.accepted() {
        let mut hs = handshake_state(&psk, &prologue, false)?;
        if let Ok(n) = hs.read_message(&first, &mut payload) {
            opened = Some((hs, n));
            break;
        }
    }
    let Some((mut hs, n)) = opened else {
        // An empty reply: the dialer learns that its secret was not accepted, nothing else.
        let _ = stream.write_all(&[0, 0]);
        let _ = stream.flush();
        return Err(HandshakeError::Unauthenticated);
    };
    let intent = decode_intent(&payload[..n])?;
    let mut reply = [0u8; MAX_HELLO];
    let len = noise(hs.write_message(&[], &mut reply))?;
    let mut out = Vec::with_capacity(2 + len);
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(&reply[..len]);
    stream.write_all(&out)?;
    stream.flush()?;
    Ok((Channel::finish(hs)?, intent))
}

fn decode_intent(bytes: &[u8]) -> Result<Intent, HandshakeError> {
    let config = bincode::config::standard().with_limit::<{ MAX_HELLO }>();
    let (intent, used): (Intent, usize) = bincode::serde::decode_from_slice(bytes, config)
        .map_err(|e| HandshakeError::Intent(e.to_string()))?;
    if used != bytes.len() {
        return Err(HandshakeError::Intent(format!(
            "{} bytes after it",
            bytes.len() - used
        )));
    }
    if intent.endpoint.len() > MAX_INTENT_ENDPOINT {
        return Err(HandshakeError::Intent(format!(
            "endpoint of {} bytes (at most {MAX_INTENT_ENDPOINT})",
            intent.endpoint.len()
        )));
    }
    Ok(intent)
}

fn read_exactly(stream: &mut impl Read, buf: &mut [u8], what: &str) -> io::Result<()> {
    stream.read_exact(buf).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the connection closed before {what}"),
            )
        } else {
            e
        }
    })
}

/// The reading half of a [`Channel`]: opens records in order and reads their plaintext.
/// A record that does not open (altered, replayed, reordered, or not from the peer) is an
/// [`io::ErrorKind::InvalidData`] error, and nothing of it is returned.
pub struct SecureReader<R> {
    inner: R,
    state: Arc<StatelessTransportState>,
    nonce: u64,
    record: Vec<u8>,
    plain: Vec<u8>,
    pos: usize,
}

impl<R> fmt::Debug for SecureReader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecureReader")
            .field("records", &self.nonce)
            .finish_non_exhaustive()
    }
}

impl<R: Read> SecureReader<R> {
    /// Records opened so far: once one has, the peer is proven.
    pub fn records_opened(&self) -> u64 {
        self.nonce
    }

    /// The connection it reads.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The connection it reads, mutably (to change its timeouts).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Reads and opens the next record; `false` at a clean end of stream between records.
    fn next_record(&mut self) -> io::Result<bool> {
        let mut l = [0u8; 2];
        if !read_start(&mut self.inner, &mut l, "record header")? {
            return Ok(false);
        }
        let len = usize::from(u16::from_le_bytes(l));
        if len < TAG_LEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a record of {len} bytes is shorter than its tag"),
            ));
        }
        self.record.resize(len, 0);
        self.inner.read_exact(&mut self.record)?;
        self.plain.resize(len - TAG_LEN, 0);
        let n = self
            .state
            .read_message(self.nonce, &self.record, &mut self.plain)
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "record {} failed authentication: altered, out of order, or not from \
                         the authenticated peer",
                        self.nonce
                    ),
                )
            })?;
        self.plain.truncate(n);
        self.pos = 0;
        self.nonce += 1;
        Ok(true)
    }
}

impl<R: Read> Read for SecureReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.plain.len() {
            if !self.next_record()? {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.plain.len() - self.pos);
        buf[..n].copy_from_slice(&self.plain[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The writing half of a [`Channel`]: what is written is sealed into records at each
/// [`flush`](Write::flush) (and whenever a record's worth is pending).
pub struct SecureWriter<W> {
    inner: W,
    state: Arc<StatelessTransportState>,
    nonce: u64,
    pending: Vec<u8>,
    out: Vec<u8>,
}

impl<W> fmt::Debug for SecureWriter<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecureWriter")
            .field("records", &self.nonce)
            .finish_non_exhaustive()
    }
}

impl<W: Write> SecureWriter<W> {
    /// The connection it writes.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// Seals `plaintext` (a whole frame) into the records that `write` and `flush` would send
    /// for it, and returns them without writing anything: for a caller that writes the
    /// connection itself (part now, the rest later). The records take this writer's next
    /// nonces, so they must reach the connection in the order they were sealed, and before
    /// anything this writer writes itself.
    ///
    /// # Errors
    ///
    /// Sealing failed (the cipher refused; the writer is then unusable), or bytes written
    /// but not yet flushed are pending (they would have to go first).
    pub fn seal_frame(&mut self, plaintext: &[u8]) -> io::Result<Vec<u8>> {
        if !self.pending.is_empty() || !self.out.is_empty() {
            return Err(io::Error::other(
                "sealing a frame while another is written but not flushed",
            ));
        }
        for record in plaintext.chunks(MAX_RECORD_PLAINTEXT) {
            self.pending.extend_from_slice(record);
            self.seal(record.len())?;
        }
        Ok(std::mem::take(&mut self.out))
    }

    fn seal(&mut self, upto: usize) -> io::Result<()> {
        let start = self.out.len();
        self.out.resize(start + 2 + upto + TAG_LEN, 0);
        let n = self
            .state
            .write_message(
                self.nonce,
                &self.pending[..upto],
                &mut self.out[start + 2..],
            )
            .map_err(|e| io::Error::other(format!("sealing a record: {e}")))?;
        self.out[start..start + 2].copy_from_slice(&(n as u16).to_le_bytes());
        self.out.truncate(start + 2 + n);
        self.nonce += 1;
        self.pending.drain(..upto);
        Ok(())
    }
}

impl<W: Write> Write for SecureWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        while self.pending.len() >= MAX_RECORD_PLAINTEXT {
            self.seal(MAX_RECORD_PLAINTEXT)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.pending.is_empty() {
            self.seal(self.pending.len())?;
        }
        let written = self.inner.write_all(&self.out);
        self.out.clear();
        written?;
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AgentMessage;
    use std::collections::VecDeque;

    /// One end of an in-memory duplex pipe.
    #[derive(Default)]
    struct End {
        input: VecDeque<u8>,
        output: Vec<u8>,
    }
    impl Read for End {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.input.len());
            for b in buf.iter_mut().take(n) {
                *b = self.input.pop_front().unwrap_or(0);
            }
            Ok(n)
        }
    }
    impl Write for End {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn secret(b: u8) -> Secret {
        Secret::new(vec![b; 32]).unwrap()
    }

    /// Runs a handshake with the dialer's first message and the acceptor's reply carried by
    /// hand: the acceptor's result, then the dialer's.
    fn handshake(
        dialer: &Secret,
        acceptor: &Secret,
    ) -> (
        Result<(Channel, Intent), HandshakeError>,
        Result<Channel, HandshakeError>,
    ) {
        // The dialer blocks on the reply, so it runs on a thread with real pipes.
        use std::os::unix::net::UnixStream;
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let d = dialer.clone();
        let t = std::thread::spawn(move || {
            dial::<AgentMessage>(
                &mut a,
                &d,
                &Intent {
                    endpoint: "ctx:1".into(),
                },
            )
        });
        let acc = accept::<AgentMessage>(&mut b, acceptor);
        drop(b);
        (acc, t.join().unwrap())
    }

    #[test]
    fn secrets_too_short_or_blank_are_refused_and_never_printed() {
        assert_eq!(
            Secret::new(b"short".to_vec()),
            Err(SecretError::Short { len: 5 })
        );
        assert_eq!(
            Secret::new(vec![b' '; 16]),
            Err(SecretError::Blank { len: 16 })
        );
        let s = Secret::new(b"0123456789abcdef-very-secret".to_vec()).unwrap();
        let shown = format!("{s:?}");
        assert!(!shown.contains("very-secret"), "{shown}");
        assert_eq!(format!("{:?}", Secret::unauthenticated()), "Secret(none)");
    }

    #[test]
    fn the_same_secret_makes_a_channel_and_records_flow_both_ways() {
        let (acc, dial) = handshake(&secret(1), &secret(1));
        let (ac, intent) = acc.unwrap();
        let dc = dial.unwrap();
        assert_eq!(intent.endpoint, "ctx:1");
        assert_eq!(ac.binding(), dc.binding());
        let (mut ar, _aw) = ac.split(End::default(), End::default());
        let (_dr, mut dw) = dc.split(End::default(), End::default());
        let big = vec![7u8; 200_000];
        dw.write_all(&big).unwrap();
        dw.flush().unwrap();
        ar.get_mut().input.extend(dw.get_ref().output.iter());
        let mut back = vec![0u8; big.len()];
        ar.read_exact(&mut back).unwrap();
        assert_eq!(back, big);
        assert_eq!(ar.records_opened(), 4);
    }

    #[test]
    fn frames_sealed_apart_are_the_records_written_and_open_in_order() {
        let channels = || {
            let (acc, dial) = handshake(&secret(1), &secret(1));
            (acc.unwrap().0, dial.unwrap())
        };
        let frames = [vec![1u8; 10], vec![2u8; 200_000], vec![3u8; 1]];
        // Twin channels: the same keys and nonces, one writing, one sealing.
        let (ac, dc) = channels();
        let (_dr, mut dw) = dc.split(End::default(), End::default());
        for f in &frames {
            dw.write_all(f).unwrap();
            dw.flush().unwrap();
        }
        let (ac2, dc2) = channels();
        let (_dr2, mut sealer) = dc2.split(End::default(), End::default());
        let mut sealed = Vec::new();
        for f in &frames {
            sealed.extend(sealer.seal_frame(f).unwrap());
        }
        assert!(sealer.get_ref().output.is_empty(), "sealing writes nothing");
        // Other keys, the same records: as many bytes, cut the same way, opening in order.
        assert_eq!(sealed.len(), dw.get_ref().output.len());
        let total = frames.iter().map(Vec::len).sum();
        for (acceptor, wire) in [(ac, dw.get_ref().output.clone()), (ac2, sealed)] {
            let (mut ar, _) = acceptor.split(End::default(), End::default());
            ar.get_mut().input.extend(wire.iter());
            let mut back = vec![0u8; total];
            ar.read_exact(&mut back).unwrap();
            assert_eq!(back, frames.concat());
            assert_eq!(ar.records_opened(), 6);
        }
        // A frame written but not flushed would go after records sealed later: refused.
        sealer.write_all(b"half").unwrap();
        let e = sealer.seal_frame(b"next").unwrap_err();
        assert!(e.to_string().contains("not flushed"), "{e}");
    }

    #[test]
    fn other_secrets_and_none_do_not_make_a_channel() {
        for (d, a) in [
            (secret(1), secret(2)),
            (Secret::unauthenticated(), secret(2)),
            (secret(1), Secret::unauthenticated()),
        ] {
            let (acc, dial) = handshake(&d, &a);
            assert!(
                matches!(acc, Err(HandshakeError::Unauthenticated)),
                "{acc:?}"
            );
            assert!(matches!(dial, Err(HandshakeError::Refused)), "{dial:?}");
            // Both sides' errors say where a secret comes from.
            for e in [acc.err(), dial.err()].into_iter().flatten() {
                assert!(e.to_string().contains("check KVFERRY_SECRET"), "{e}");
            }
        }
        let (acc, dial) = handshake(&Secret::unauthenticated(), &Secret::unauthenticated());
        assert!(acc.is_ok() && dial.is_ok());
    }

    #[test]
    fn an_acceptor_also_accepting_the_previous_secret_takes_both() {
        let rotating = secret(2).also_accepting(secret(1));
        for d in [secret(1), secret(2)] {
            let (acc, dial) = handshake(&d, &rotating);
            assert!(acc.is_ok() && dial.is_ok());
        }
        let (acc, _) = handshake(&secret(3), &rotating);
        assert!(matches!(acc, Err(HandshakeError::Unauthenticated)));
    }

    #[test]
    fn altered_reordered_or_replayed_records_do_not_open() {
        let (acc, dial) = handshake(&secret(1), &secret(1));
        let (ac, _) = acc.unwrap();
        let (_dr, mut dw) = dial.unwrap().split(End::default(), End::default());
        for m in [&b"one"[..], b"two"] {
            dw.write_all(m).unwrap();
            dw.flush().unwrap();
        }
        let wire = dw.get_ref().output.clone();
        let (first, second) = wire.split_at(2 + 3 + TAG_LEN);
        let cases: Vec<Vec<u8>> = vec![
            {
                let mut w = wire.clone();
                w[4] ^= 1;
                w
            },
            [second, first].concat(),
            [first, first].concat(),
        ];
        let (mut ar, _) = ac.split(End::default(), End::default());
        let mut buf = [0u8; 3];
        ar.get_mut().input.extend(first.iter());
        ar.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"one");
        // The first again (replayed): it does not open as record 1.
        ar.get_mut().input.extend(first.iter());
        let e = ar.read_exact(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        for case in cases {
            let (acc, dial) = handshake(&secret(1), &secret(1));
            let (ac, _) = acc.unwrap();
            drop(dial);
            let (mut r, _) = ac.split(End::default(), End::default());
            r.get_mut().input.extend(case.iter());
            let mut all = Vec::new();
            assert!(r.read_to_end(&mut all).is_err(), "{case:?}");
        }
    }

    #[test]
    fn an_oversized_or_foreign_first_message_is_refused_before_it_is_read() {
        let mut pre = b"KVFA".to_vec();
        pre.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        pre.extend_from_slice(&(MAX_HELLO as u16 + 1).to_le_bytes());
        let mut end = End::default();
        end.input.extend(pre.iter());
        let e = accept::<AgentMessage>(&mut end, &secret(1)).unwrap_err();
        assert!(matches!(e, HandshakeError::Oversized { len: 1025 }), "{e}");
        let mut end = End::default();
        end.input.extend(b"KVFC\x04\x00\x10\x00".iter());
        let e = accept::<AgentMessage>(&mut end, &secret(1)).unwrap_err();
        assert!(e.to_string().contains("not a kvferry agent frame"), "{e}");
    }
}
