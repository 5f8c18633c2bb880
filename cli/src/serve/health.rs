//! The `/healthz` body of `kvtier serve`, from the health of the tiers it serves.

use kvtier::contract::secondary::{HealthState, TierHealth};

/// The `/healthz` answer for the tiers' health: `ok`; `degraded` and one line per problem
/// (still 200: the tiers serve); or, when a tier cannot serve, `failed` and the problems (503).
pub fn health_body(tiers: &[(String, TierHealth)]) -> std::result::Result<String, String> {
    let worst = tiers.iter().map(|(_, h)| h.state).max().unwrap_or_default();
    let mut body = match worst {
        HealthState::Ok => return Ok("ok\n".to_string()),
        HealthState::Degraded => "degraded\n".to_string(),
        HealthState::Failed => "failed\n".to_string(),
    };
    for (label, h) in tiers {
        for p in &h.problems {
            body.push_str(&format!("tier {label}: {p}\n"));
        }
    }
    if worst == HealthState::Failed {
        Err(body)
    } else {
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_body_is_200_while_tiers_serve_and_503_when_one_cannot() {
        let ok = TierHealth::default();
        let mut degraded = TierHealth::default();
        degraded.add(HealthState::Degraded, "path 1 (/b) takes no writes: EIO");
        let mut failed = TierHealth::default();
        failed.add(HealthState::Failed, "index recovery failed");
        let t = |h: &TierHealth| {
            vec![
                ("1:nvme".to_string(), ok.clone()),
                ("2:nvme".to_string(), h.clone()),
            ]
        };
        assert_eq!(health_body(&t(&ok)), Ok("ok\n".to_string()));
        assert_eq!(
            health_body(&t(&degraded)),
            Ok("degraded\ntier 2:nvme: path 1 (/b) takes no writes: EIO\n".to_string())
        );
        assert_eq!(
            health_body(&t(&failed)),
            Err("failed\ntier 2:nvme: index recovery failed\n".to_string())
        );
        assert_eq!(health_body(&[]), Ok("ok\n".to_string()));
    }
}
