//! Keep-alives flow on every link a decode rank writes through, not only on the one its
//! directory holds: requests expected together, before the prefill rank is linked, each dial
//! it, and a request whose link fell silent to the prefill for a peer timeout was failed by
//! the prefill's read timeout ("closed its connection") although both agents were alive.

use std::time::{Duration, Instant};

use kvferry_loader::Registry;
use kvferry_planner_abi::{Mapping, MemoryType, RankInfo, SlotTable, TokenRange};
use kvferry_testkit::builder::{Deploy, Model};
use kvferry_transfer::Role;
use kvferry_transfer::agent::{Agent, AgentConfig, Event, Expect, Secret, SendChunk};

const PEER_TIMEOUT: Duration = Duration::from_millis(600);
const REQUESTS: u64 = 4;

/// Pools over buffers this test owns; alive for the agent's life.
struct Engine {
    _buffers: Vec<Vec<u64>>,
    info: RankInfo,
}

impl Engine {
    fn new(name: &str, model: &Model) -> Engine {
        let deploy = Deploy::new(name, 1, "tp1".parse::<Mapping>().unwrap(), model);
        let mut buffers: Vec<Vec<u64>> = Vec::new();
        let mut info = deploy.rank_in(model, 0, &mut |_, _, bytes| {
            let mut b = vec![0u64; bytes.div_ceil(8) as usize];
            let base = b.as_mut_ptr() as u64;
            buffers.push(b);
            base
        });
        for p in info.page_table.pools.iter_mut() {
            p.memory_type = MemoryType::DRAM;
        }
        Engine {
            _buffers: buffers,
            info,
        }
    }
}

fn agent(role: Role, engine: &Engine) -> Agent {
    let registry = Registry::from_modules([(kvferry_planner_default::planner_module(), "linked")]);
    let deployment = kvferry_planner_abi::Deployment {
        architecture: "llama".into(),
        mapping: "tp1".parse::<Mapping>().unwrap(),
    };
    let bound = registry.bind("kvferry.default", &deployment).unwrap();
    let name = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let secret = Secret::new(b"a deployment secret of 32 bytes!".to_vec()).unwrap();
    let mut config = AgentConfig::new(name, role, engine.info.clone(), secret);
    config.listen = "127.0.0.1:0".into();
    config.timeout = Duration::from_secs(20);
    config.peer_timeout = PEER_TIMEOUT;
    // SAFETY: the engine's buffers outlive the agent (dropped first below); nothing reads
    // or writes them meanwhile.
    unsafe { Agent::start(config, bound) }.unwrap()
}

fn send(request: u64, start: u64, end: u64) -> SendChunk {
    SendChunk {
        request,
        tables: vec![SlotTable::new([request as i64 * 2, request as i64 * 2 + 1])],
        tokens: TokenRange { start, end },
        prompt_len: 32,
        is_last: end == 32,
        to: None,
        views: None,
    }
}

#[test]
fn requests_expected_together_survive_a_quiet_spell_longer_than_the_peer_timeout() {
    let model = Model {
        slots: 2 * REQUESTS,
        ..Model::gqa(2, 2, 16, 16)
    };
    let src = Engine::new("prefill", &model);
    let dst = Engine::new("decode", &model);
    let prefill = agent(Role::Prefill, &src);
    let decode = agent(Role::Decode, &dst);
    let endpoint = prefill.endpoint().unwrap().to_string();
    // The first half of every request, then the decode expects them all at once: each
    // dispatch dials the prefill rank, which nobody has linked yet.
    for r in 0..REQUESTS {
        prefill.send(send(r, 0, 16)).unwrap();
    }
    for r in 0..REQUESTS {
        decode
            .expect(Expect {
                request: r,
                peer: "prefill".into(),
                endpoints: vec![endpoint.clone()],
                ctx_dp_rank: 0,
                prompt_len: 32,
                cached_prefix: None,
                tables: vec![SlotTable::new([r as i64 * 2, r as i64 * 2 + 1])],
                excluded_views: Vec::new(),
            })
            .unwrap();
    }
    // Both agents are alive and idle for three peer timeouts; then the second halves go.
    std::thread::sleep(3 * PEER_TIMEOUT);
    let early = prefill.poll();
    assert!(
        early.is_empty(),
        "requests ended while both agents were alive: {early:?}"
    );
    for r in 0..REQUESTS {
        prefill.send(send(r, 16, 32)).unwrap();
    }
    let mut ended = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ended.len() < REQUESTS as usize && Instant::now() < deadline {
        ended.extend(decode.poll());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ended.len(), REQUESTS as usize, "{ended:?}");
    for e in &ended {
        assert!(matches!(e, Event::Received { .. }), "{e:?}");
    }
    drop(decode);
    drop(prefill);
}
