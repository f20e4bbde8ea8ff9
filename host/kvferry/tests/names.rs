//! Every type the facade's public signatures name can be named through `kvferry::` alone.
//!
//! Each re-exported type is tied below, by its facade path, to the field, variant, argument
//! or return value of a facade item where it appears: removing a re-export, or pointing it
//! at another type than the one the signature uses, fails to compile. A type that appears in
//! a new signature belongs here too.

use std::path::Path;
use std::sync::Arc;

use kvferry::abi::Deployment;
use kvferry::agent::{
    AgentConfig, AgentMetadata, BindError, Event, ExecConfig, HarnessOptions, HostBudget,
    LoadSecretError, MemoryError, PoolKey, RankDescriptor, RequestStats, Secret, SecretError,
    SpawnError, Stages, StartError, WireError, load_secret,
};
use kvferry::planning::{Fragments, ValidatedPlan};
use kvferry::registry::{BoundPlanner, Candidate, CandidateRefusal, PlannerInfo, Registry};
use kvferry::ucx;
use kvferry::{Transport, TransportSpec, Transports};

/// The request's numbers in the events an agent returns.
fn event_stats(event: &Event) -> (Option<&RequestStats>, Option<&Stages>) {
    match event {
        Event::Received { stats, .. } => (Some(stats), Some(&stats.stages)),
        Event::Sent { stages, .. } => (None, Some(stages)),
        _ => (None, None),
    }
}

/// The errors inside an agent's start error, down to UCX's and the device's.
fn start_error_parts(e: &StartError) -> Option<&ucx::Error> {
    match e {
        StartError::Context { source, .. } | StartError::Worker(source) => Some(source),
        StartError::Memory(m) => memory_error_parts(m).1,
        StartError::Spawn(s) => spawn_error_parts(s).1,
        _ => None,
    }
}

fn memory_error_parts(e: &MemoryError) -> (Option<&HostBudget>, Option<&ucx::Error>) {
    match e {
        MemoryError::HostMemory { budget, .. } => (Some(budget), None),
        MemoryError::Allocate { source, .. } | MemoryError::PackKey { source, .. } => {
            (None, Some(source))
        }
        _ => (None, None),
    }
}

#[cfg(feature = "cuda")]
fn cuda_error(e: &MemoryError) -> Option<&kvferry::agent::CudaError> {
    match e {
        MemoryError::Cuda(c) | MemoryError::CudaPool { error: c, .. } => Some(c),
        _ => None,
    }
}

fn spawn_error_parts(e: &SpawnError) -> (Option<&BindError>, Option<&ucx::Error>) {
    match e {
        SpawnError::Bind { source, .. } => (Some(source), None),
        SpawnError::Address { source, .. } => (None, Some(source)),
        _ => (None, None),
    }
}

fn secret_error(e: &LoadSecretError) -> Option<&SecretError> {
    match e {
        LoadSecretError::Invalid(s) => Some(s),
        _ => None,
    }
}

fn key_layout(e: &ucx::KeyFormatError) -> Option<ucx::KeyLayout> {
    match e {
        ucx::KeyFormatError::UnknownMemoryType { layout, .. } => Some(*layout),
        _ => None,
    }
}

fn metadata_parts(m: &AgentMetadata) -> (&RankDescriptor, &[PoolKey]) {
    (&m.rank, &m.rank.pools)
}

fn transports(spec: &TransportSpec) -> &Transports {
    &spec.transports
}

fn config_parts(config: &AgentConfig) -> (&HarnessOptions, &ExecConfig) {
    (&config.harness, &config.executor)
}

fn refusal(candidate: &Candidate) -> Option<&CandidateRefusal> {
    candidate.verdict.as_ref().err()
}

#[test]
fn every_type_in_the_facades_signatures_is_named_through_it() {
    // Calls and methods, by the types they take and return.
    let _: fn(Option<&Path>) -> Result<Secret, LoadSecretError> = load_secret;
    let _: fn(&[u8]) -> Result<AgentMetadata, WireError> = AgentMetadata::from_bytes;
    let _: fn(&AgentMetadata) -> Result<Vec<u8>, WireError> = AgentMetadata::to_bytes;
    let _: fn(Transport) -> Result<Arc<ucx::Context>, ucx::Error> = Transport::context;
    let _: fn(&TransportSpec) -> ucx::ErrorMode = TransportSpec::error_mode;
    let _: fn() -> ucx::ContextBuilder = ucx::Context::builder;
    let _: fn(&ucx::Context) -> Result<ucx::MemoryTypes, ucx::Error> = ucx::Context::memory_types;
    let _: fn(ucx::MemoryTypes, ucx::MemoryType) -> bool = ucx::MemoryTypes::contains;
    let _: fn(&ucx::Error) -> ucx::Status = ucx::Error::status;
    let _: fn(&ucx::Error) -> ucx::Op = ucx::Error::op;
    let _: fn(&ucx::Error) -> Option<&ucx::KeyFormatError> = ucx::Error::key_format;
    let _: fn(&BoundPlanner) -> &PlannerInfo = BoundPlanner::info;
    let _: fn(&Registry, &Deployment) -> Vec<Candidate> = Registry::candidates;
    let _: fn(&ValidatedPlan) -> Fragments<'_> = ValidatedPlan::fragments;

    // Fields and variants, by the types they hold.
    let _ = (
        event_stats,
        start_error_parts,
        memory_error_parts,
        spawn_error_parts,
    );
    let _ = (secret_error, key_layout, metadata_parts, transports);
    let _ = (config_parts, refusal);
    #[cfg(feature = "cuda")]
    let _ = cuda_error;

    // What an engine builds or keeps of them works through the facade's names.
    let stats = RequestStats {
        stages: Stages {
            puts_ns: 3,
            ..Stages::default()
        },
        ..RequestStats::default()
    };
    let event = Event::Received { request: 1, stats };
    assert_eq!(event_stats(&event).1.map(|s| s.total_ns()), Some(3));
    assert!(HarnessOptions::default().hook.is_none());
}
