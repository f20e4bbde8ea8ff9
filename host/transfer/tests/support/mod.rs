//! Shared by the agent tests: "engine" memory a test owns, agents over it, waiting for
//! events, and the byte check (every destination slot written holds its source, every other
//! byte its canary).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_loader::BoundPlanner;
use kvferry_loader::Registry;
use kvferry_plan::ValidatedPlan;
use kvferry_planner_abi::{Mapping, MemoryType, RankInfo, SlotTable, TokenRange};
use kvferry_testkit::builder::{Deploy, Model};
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{Agent, AgentConfig, Event, Expect, Secret, SendChunk};
use kvferry_transfer::harness::rank::{RemoteRank, WriteHook};

pub mod ranks;

pub const CANARY: u8 = 0xA5;

/// The default planner, linked, bound for a tp1 Llama-shaped deployment.
pub fn bound() -> BoundPlanner {
    let registry = Registry::from_modules([(kvferry_planner_default::planner_module(), "linked")]);
    let deployment = kvferry_planner_abi::Deployment {
        architecture: "llama".into(),
        mapping: "tp1".parse::<Mapping>().unwrap(),
    };
    registry.bind("kvferry.default", &deployment).unwrap()
}

/// Holds every write job for a while after its puts were issued, before its flush.
#[derive(Debug)]
pub struct SlowFlush(pub Duration);

impl WriteHook for SlowFlush {
    fn before_flush(&self, _: &RemoteRank, _: &ValidatedPlan) {
        std::thread::sleep(self.0);
    }
}

/// [`SlowFlush`] that also says when a job has reached its flush (its puts issued).
#[derive(Debug)]
pub struct FlushGate {
    delay: Duration,
    entered: std::sync::Mutex<std::sync::mpsc::Sender<()>>,
}

impl FlushGate {
    /// The hook, holding every job `delay` before its flush, and where it tells of each.
    pub fn new(delay: Duration) -> (Arc<FlushGate>, std::sync::mpsc::Receiver<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let gate = FlushGate {
            delay,
            entered: std::sync::Mutex::new(tx),
        };
        (Arc::new(gate), rx)
    }
}

impl WriteHook for FlushGate {
    fn before_flush(&self, _: &RemoteRank, _: &ValidatedPlan) {
        let _ = self.entered.lock().unwrap().send(());
        std::thread::sleep(self.delay);
    }
}

/// Engine memory: one buffer per pool, kept alive for the agent's life.
pub struct Engine {
    pub buffers: Vec<Vec<u64>>,
    pub info: RankInfo,
}

impl Engine {
    pub fn new(name: &str, model: &Model, fill: impl Fn(usize, usize) -> u8) -> Engine {
        let deploy = Deploy::new(name, 1, "tp1".parse::<Mapping>().unwrap(), model);
        let mut buffers: Vec<Vec<u64>> = Vec::new();
        let mut info = deploy.rank_in(model, 0, &mut |_, _, bytes| {
            let words = bytes.div_ceil(8) as usize;
            let mut b = vec![0u64; words];
            let base = b.as_mut_ptr() as u64;
            buffers.push(b);
            base
        });
        for p in info.page_table.pools.iter_mut() {
            p.memory_type = MemoryType::DRAM;
        }
        let mut engine = Engine { buffers, info };
        for p in 0..engine.buffers.len() {
            for (i, byte) in engine.bytes_mut(p).iter_mut().enumerate() {
                *byte = fill(p, i);
            }
        }
        engine
    }

    pub fn bytes_mut(&mut self, pool: usize) -> &mut [u8] {
        let b = &mut self.buffers[pool];
        let len = b.len() * 8;
        // SAFETY: a Vec<u64> of `len / 8` words is `len` initialised bytes.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<u8>(), len) }
    }

    pub fn bytes(&self, pool: usize) -> &[u8] {
        let b = &self.buffers[pool];
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), b.len() * 8) }
    }
}

pub fn model() -> Model {
    // 4 layers, 8 KV heads of 128, 16 tokens per block: Llama-shaped, small.
    Model::gqa(4, 8, 128, 16)
}

pub fn agent(role: Role, engine: &Engine, secret: Secret, transport: Transport) -> Agent {
    agent_with(role, engine, secret, transport, None)
}

pub fn agent_with(
    role: Role,
    engine: &Engine,
    secret: Secret,
    transport: Transport,
    hook: Option<Arc<dyn WriteHook>>,
) -> Agent {
    start(role, engine, secret, bound(), |config| {
        config.transport = transport.into();
        config.harness.hook = hook;
    })
}

/// An agent of `role` over `engine` with `bound`, on loopback tcp, after `tweak`.
pub fn start(
    role: Role,
    engine: &Engine,
    secret: Secret,
    bound: BoundPlanner,
    tweak: impl FnOnce(&mut AgentConfig),
) -> Agent {
    let name = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let mut config = AgentConfig::new(name, role, engine.info.clone(), secret);
    config.listen = "127.0.0.1:0".into();
    config.timeout = Duration::from_secs(10);
    config.peer_timeout = Duration::from_secs(3);
    tweak(&mut config);
    // SAFETY: the engine's buffers outlive the agent (every test drops agents first) and
    // are read only after the request's terminal event.
    unsafe { Agent::start(config, bound) }.unwrap()
}

/// The terminal events of `requests`, one each (a second for any request fails the test).
pub fn wait_all(
    agent: &Agent,
    requests: &[u64],
    limit: Duration,
) -> std::collections::BTreeMap<u64, Event> {
    let deadline = Instant::now() + limit;
    let mut got = std::collections::BTreeMap::new();
    while got.len() < requests.len() {
        for e in agent.poll() {
            assert!(
                requests.contains(&e.request()),
                "an event for another request: {e:?}"
            );
            let r = e.request();
            assert!(
                got.insert(r, e).is_none(),
                "two terminal events for request {r}"
            );
        }
        assert!(Instant::now() < deadline, "events so far: {got:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    got
}

/// The terminal event of `request`; events of other requests seen meanwhile are dropped
/// (use [`wait_all`] for several).
pub fn wait(agent: &Agent, request: u64, limit: Duration) -> Event {
    let deadline = Instant::now() + limit;
    loop {
        let mut events = agent.poll();
        if let Some(i) = events.iter().position(|e| e.request() == request) {
            let e = events.remove(i);
            assert!(
                events.iter().all(|e| e.request() != request),
                "two terminal events"
            );
            return e;
        }
        assert!(Instant::now() < deadline, "no event for request {request}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn secret() -> Secret {
    Secret::new(b"a deployment secret of 32 bytes!".to_vec()).unwrap()
}

pub fn tables(engine: &Engine, slots: &[i64]) -> Vec<SlotTable> {
    engine
        .info
        .page_table
        .groups
        .iter()
        .map(|_| SlotTable::new(slots.iter().copied()))
        .collect()
}

/// Every destination slot in `dst_slots` holds its source slot's bytes; the partly filled
/// block `partial` (source, destination) holds, byte for byte, its source's byte or the
/// canary, and some of the source's; every other byte of the destination pools is still the
/// canary.
pub fn check(
    src: &Engine,
    dst: &Engine,
    src_slots: &[i64],
    dst_slots: &[i64],
    partial: Option<(i64, i64)>,
) {
    for (p, pool) in dst.info.page_table.pools.iter().enumerate() {
        let (sb, db) = (src.bytes(p), dst.bytes(p));
        let stride = pool.slot_stride as usize;
        let bytes = pool.slot_bytes as usize;
        let mut written = vec![false; db.len()];
        for (&s, &d) in src_slots.iter().zip(dst_slots) {
            let (s, d) = (s as usize * stride, d as usize * stride);
            assert_eq!(&db[d..d + bytes], &sb[s..s + bytes], "pool {p} slot at {d}");
            written[d..d + bytes].iter_mut().for_each(|w| *w = true);
        }
        if let Some((s, d)) = partial {
            let (s, d) = (s as usize * stride, d as usize * stride);
            let mut from_source = 0;
            for i in 0..bytes {
                let b = db[d + i];
                assert!(
                    b == sb[s + i] || b == CANARY,
                    "pool {p} partial block byte {i}: {b:#x}"
                );
                from_source += usize::from(b == sb[s + i] && b != CANARY);
            }
            assert!(
                from_source > 0,
                "pool {p}: nothing of the partial block landed"
            );
            written[d..d + bytes].iter_mut().for_each(|w| *w = true);
        }
        for (i, (&b, &w)) in db.iter().zip(&written).enumerate() {
            assert!(w || b == CANARY, "pool {p} byte {i} touched: {b:#x}");
        }
    }
}

pub fn pattern(p: usize, i: usize) -> u8 {
    ((i * 131 + p * 7 + i / 4096) % 251) as u8
}

/// A send of the whole `prompt_len`-token prompt in one chunk, from `tables`, to anyone.
pub fn whole(request: u64, tables: Vec<SlotTable>, prompt_len: u64) -> SendChunk {
    SendChunk {
        request,
        tables,
        tokens: TokenRange {
            start: 0,
            end: prompt_len,
        },
        prompt_len,
        is_last: true,
        to: None,
        views: None,
    }
}

/// An expect of a `prompt_len`-token request from instance `prefill` through `endpoint`,
/// into `tables`, nothing cached or excluded.
pub fn expecting(request: u64, endpoint: &str, tables: Vec<SlotTable>, prompt_len: u64) -> Expect {
    Expect {
        request,
        peer: "prefill".into(),
        endpoints: vec![endpoint.to_string()],
        ctx_dp_rank: 0,
        prompt_len,
        cached_prefix: None,
        tables,
        excluded_views: Vec::new(),
    }
}

/// Cancels a 4-block request on `decode` while `prefill`'s write job for it sleeps before its
/// flush (a [`FlushGate`] of 400 ms installed on `prefill`, which tells `flushing` when the
/// job gets there); checks that `Cancelled` comes, that the prefill side ends it too, and
/// that no byte lands in the slots after the engine reused them right after `Cancelled`.
/// Drops both agents.
pub fn cancel_mid_write(
    prefill: Agent,
    decode: Agent,
    src: &Engine,
    dst: &mut Engine,
    flushing: std::sync::mpsc::Receiver<()>,
) {
    let slots = [0i64, 1, 2, 3];
    decode
        .expect(expecting(
            3,
            prefill.endpoint().unwrap(),
            tables(dst, &slots),
            64,
        ))
        .unwrap();
    prefill.send(whole(3, tables(src, &slots), 64)).unwrap();
    // The job is past its puts and sleeping before its flush (waiting for that, not for a
    // fixed time: on a loaded machine the claim may not even have reached the prefill rank
    // after a while, and a cancel then ends the request before it is claimed).
    flushing
        .recv_timeout(Duration::from_secs(20))
        .expect("the write job reached its flush");
    decode.cancel(3).unwrap();
    assert_eq!(
        wait(&decode, 3, Duration::from_secs(10)),
        Event::Cancelled { request: 3 }
    );
    // The engine reuses the slots at once: nothing of the request may land after this.
    const REUSED: u8 = 0x5A;
    for p in 0..dst.buffers.len() {
        dst.bytes_mut(p).fill(REUSED);
    }
    let ended = wait(&prefill, 3, Duration::from_secs(10));
    assert!(
        matches!(
            ended,
            Event::Sent { .. }
                | Event::Failed {
                    kind: kvferry_transfer::agent::FailureKind::CancelledByPeer,
                    ..
                }
        ),
        "{ended:?}"
    );
    std::thread::sleep(Duration::from_millis(300));
    drop(decode);
    drop(prefill);
    for p in 0..dst.buffers.len() {
        assert!(
            dst.bytes(p).iter().all(|&b| b == REUSED),
            "pool {p}: a write landed after Cancelled"
        );
    }
}

/// One end of a secured side-channel connection, read and written as one stream (for tests
/// that speak the agent protocol by hand).
pub struct SecurePeer {
    reader: kvferry_transfer::harness::conn::Reader,
    writer: kvferry_transfer::harness::conn::Writer,
    /// The session's handshake hash.
    pub binding: [u8; 32],
}

impl std::io::Read for SecurePeer {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.reader.read(buf)
    }
}

impl std::io::Write for SecurePeer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.writer.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }
}

impl SecurePeer {
    fn new(secured: kvferry_transfer::harness::conn::Secured) -> SecurePeer {
        let kvferry_transfer::harness::conn::Secured {
            mut reader,
            writer,
            binding,
            ..
        } = secured;
        reader
            .get_mut()
            .get_mut()
            .settle(Some(Duration::from_secs(10)))
            .unwrap();
        SecurePeer {
            reader,
            writer,
            binding,
        }
    }

    /// Dials `endpoint` and runs the handshake with `secret`.
    pub fn dial(
        endpoint: &str,
        secret: &Secret,
    ) -> Result<SecurePeer, kvferry_protocol::secure::HandshakeError> {
        let s = std::net::TcpStream::connect(endpoint).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        kvferry_transfer::harness::conn::secure_dial::<kvferry_protocol::AgentMessage>(
            s, secret, endpoint, deadline,
        )
        .map(SecurePeer::new)
    }

    /// Accepts one connection on `listener` and runs the handshake with `secret`.
    pub fn accept(listener: &std::net::TcpListener, secret: &Secret) -> Option<SecurePeer> {
        let (s, _) = listener.accept().ok()?;
        let deadline = Instant::now() + Duration::from_secs(5);
        kvferry_transfer::harness::conn::secure_accept::<kvferry_protocol::AgentMessage>(
            s, secret, deadline,
        )
        .ok()
        .map(|(secured, _)| SecurePeer::new(secured))
    }
}

/// A UCX worker of the test's own (tcp), progressed on its own thread, that keeps the
/// worker challenges sent to it: the worker a hand-written decode rank declares, and
/// proves it owns.
pub struct HandWorker {
    /// Its UCX address.
    pub address: Vec<u8>,
    challenges: std::sync::mpsc::Receiver<Vec<u8>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HandWorker {
    pub fn start() -> HandWorker {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (address_tx, address_rx) = std::sync::mpsc::channel();
        let (tx, challenges) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let ctx = Transport::Tcp.context().expect("UCX context");
            let worker = kvferry_ucx::Worker::new(&ctx).expect("worker");
            worker
                .set_am_handler(
                    kvferry_protocol::agent::WORKER_CHALLENGE_AM,
                    move |_, payload| {
                        let _ = tx.send(payload.to_vec());
                    },
                )
                .expect("handler");
            address_tx.send(worker.address().expect("address")).unwrap();
            while !stopping.load(Ordering::Acquire) {
                if !worker.progress() {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        });
        HandWorker {
            address: address_rx.recv().expect("the worker started"),
            challenges,
            stop,
            thread: Some(thread),
        }
    }

    /// The challenge this worker received for the session bound by `binding` (empty if
    /// none came within 5 s).
    pub fn challenge_for(&self, binding: &[u8; 32]) -> Vec<u8> {
        let tag = kvferry_protocol::agent::worker_challenge_tag(binding);
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Ok(p) = self
            .challenges
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if p.len() == 64 && p[..32] == tag {
                return p[32..].to_vec();
            }
        }
        Vec::new()
    }
}

impl Drop for HandWorker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An authenticated session to `endpoint` posing as `decode`'s rank (it holds the secret),
/// declaring (and proving) a worker of its own: the prefill rank's puts go to that worker,
/// at the addresses of `decode`'s keys (in this process).
pub fn authenticated(
    endpoint: &str,
    decode: &Agent,
) -> (SecurePeer, kvferry_protocol::AgentSession, HandWorker) {
    use kvferry_protocol::{
        AgentEvent, AgentMessage, AgentMetadata, AgentSession, read_frame, write_frame,
    };
    let mut s = SecurePeer::dial(endpoint, &secret()).unwrap();
    let hand = HandWorker::start();
    let mut me = AgentMetadata::from_bytes(&decode.local_metadata().unwrap()).unwrap();
    me.rank.worker_address = hand.address.clone();
    let (mut session, own) = AgentSession::dial(me);
    write_frame(&mut s, &own).unwrap();
    loop {
        let m: AgentMessage = read_frame(&mut s).unwrap();
        match session.receive(m).unwrap() {
            AgentEvent::Metadata(_) => break,
            AgentEvent::ProveWorker => {
                let challenge = hand.challenge_for(&s.binding);
                write_frame(&mut s, &AgentMessage::WorkerProof { challenge }).unwrap();
            }
            other => panic!("{other:?}"),
        }
    }
    session.ready().unwrap();
    (s, session, hand)
}

/// A prefill rank under `real`'s description (its endpoint swapped for a new listener) that
/// holds the secret, admits the first decode rank to dial it, and answers each of its
/// claims with `answer`'s completion, writing nothing. Returns the endpoint.
pub fn lying_context(
    real: &Agent,
    answer: impl Fn(&kvferry_protocol::RequestData) -> kvferry_protocol::Completion
    + std::marker::Send
    + 'static,
) -> String {
    use kvferry_protocol::{
        AgentEvent, AgentMessage, AgentMetadata, AgentSession, read_frame, write_frame,
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let mut me = AgentMetadata::from_bytes(&real.local_metadata().unwrap()).unwrap();
    me.endpoint = Some(endpoint.clone());
    std::thread::spawn(move || {
        let Some(mut s) = SecurePeer::accept(&listener, &secret()) else {
            return;
        };
        let mut session = AgentSession::accept();
        loop {
            let Ok(m) = read_frame::<AgentMessage>(&mut s) else {
                return;
            };
            match session.receive(m) {
                Ok(AgentEvent::Metadata(_)) => {
                    let reply = session.admit(me.clone()).unwrap();
                    write_frame(&mut s, &reply).unwrap();
                }
                Ok(AgentEvent::RequestData(d)) => {
                    write_frame(&mut s, &AgentMessage::Completion(answer(&d))).unwrap();
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    endpoint
}

/// A successful last piece of `bytes` bytes for claim `d` (one fragment), bounced as `bounce`
/// says: what [`lying_context`]s answer.
pub fn made_up_completion(
    d: &kvferry_protocol::RequestData,
    bytes: u64,
    bounce: Option<kvferry_protocol::BouncedPiece>,
) -> kvferry_protocol::Completion {
    kvferry_protocol::Completion {
        request: d.request,
        sender_rank: d.sender_rank,
        receiver_rank: d.receiver_rank,
        piece: 0,
        is_last: true,
        bytes,
        fragments: 1,
        status: kvferry_protocol::CompletionStatus::Ok,
        bounce,
        digest: None,
        views: None,
    }
}

/// A 70-token request sent in two chunks from slots `[3, 6, 1, 7, 5]` into `[4, 2, 7, 5, 0]`
/// (request 7, to instance `decode`): the receiver's terminal event, once the sender's is
/// `Sent`.
pub fn chunked_request(prefill: &Agent, decode: &Agent, src: &Engine, dst: &Engine) -> Event {
    let src_slots = [3i64, 6, 1, 7, 5];
    let dst_slots = [4i64, 2, 7, 5, 0];
    let prompt = 70;
    let endpoint = prefill.endpoint().unwrap().to_string();
    decode
        .expect(expecting(7, &endpoint, tables(dst, &dst_slots), prompt))
        .unwrap();
    for (slots, tokens) in [
        (&src_slots[..2], TokenRange { start: 0, end: 32 }),
        (
            &src_slots[..],
            TokenRange {
                start: 32,
                end: prompt,
            },
        ),
    ] {
        prefill
            .send(SendChunk {
                request: 7,
                tables: tables(src, slots),
                tokens,
                prompt_len: prompt,
                is_last: tokens.end == prompt,
                to: Some("decode".into()),
                views: None,
            })
            .unwrap();
    }
    let got = wait(decode, 7, Duration::from_secs(20));
    let sent = wait(prefill, 7, Duration::from_secs(20));
    assert!(matches!(sent, Event::Sent { .. }), "{sent:?}");
    got
}

/// The name libtest gives test `test` of the module at `module_path` (`module_path!()` there):
/// the path below the crate, for re-running this binary on that test alone (`--exact`).
pub fn test_named(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}
