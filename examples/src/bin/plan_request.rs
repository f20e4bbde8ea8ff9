//! Plan one request between two deployments with the library API, and check every byte.

use std::sync::Arc;

use anyhow::{Result, bail};
use kvferry::abi::{Deployment, Mapping, PlanError, RankInfo, TransferPlanner};
use kvferry::registry::Registry;
use kvferry_testkit::layout::{ModelSpec, Preset};
use kvferry_testkit::scenario::Scenario;

fn main() -> Result<()> {
    let id = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "kvferry.deepseek_mla_latent".to_string());
    // The same rules as the CLI: KVFERRY_PLUGIN_DIR, else the executable's directory.
    let registry = Registry::scan(&kvferry::registry::plugin_dirs(&[]));
    let model = ModelSpec::new(Preset::DeepseekV3);
    let (ctx, decode) = ("dep4".parse::<Mapping>()?, "dep8".parse::<Mapping>()?);
    let deployment = |mapping| Deployment {
        architecture: model.architecture().into(),
        mapping,
    };
    let ctx_planner = registry.bind(&id, &deployment(ctx))?;
    let gen_planner = registry.bind(&id, &deployment(decode))?;

    let mut request = Scenario::new(model.clone(), ctx, decode, 4096);
    request.planner_id = id.clone();
    request.ctx_dp_rank = 2;
    request.gen_dp_rank = 5;
    let report = request.run(
        &|r: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> {
            ctx_planner.instantiate(r)
        },
        &|r: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> {
            gen_planner.instantiate(r)
        },
    )?;
    println!("{id} ({}):\n{report}", ctx_planner.path().display());
    if !report.is_ok() {
        bail!("the oracle found wrong bytes");
    }
    Ok(())
}
