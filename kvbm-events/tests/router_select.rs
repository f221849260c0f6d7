//! The selector's cost (Dynamo's default) and the load tracker, as data.

mod common;

use std::time::{Duration, Instant};

use kvbm_events::router::{
    select, Candidate, LoadTracker, RouterMode, SelectorConfig, WorkerLoad, DYNAMO_WEIGHTS,
};
use rand::SeedableRng;

use common::{cand, load};

#[test]
fn costs_follow_dynamos_formula() {
    // 160 input tokens in 16-token blocks: 10 blocks of prefill.
    let idle = WorkerLoad::default();
    let cases: Vec<(SelectorConfig, Candidate, f64)> = vec![
        (dynamo(), cand(1, 6, 0, 0, idle), 4.0),
        // 2 + 0.75 * 4 + 0.25 * 4 = 6 blocks of credit.
        (dynamo(), cand(2, 2, 4, 4, idle), 4.0),
        // Credit beyond the prefill is worth nothing more.
        (dynamo(), cand(3, 30, 0, 0, idle), 0.0),
        // Prefill already queued on the worker: (32 + 160) / 16 = 12 blocks.
        (dynamo(), cand(4, 0, 0, 0, load(32, 0, 1)), 12.0),
        // Decode blocks count one for one; active requests by their weight.
        (dynamo(), cand(5, 0, 0, 0, load(0, 5, 3)), 15.0),
        (
            SelectorConfig {
                decode_active_request_weight: 2.0,
                ..dynamo()
            },
            cand(6, 0, 0, 0, load(0, 5, 3)),
            21.0,
        ),
        (
            SelectorConfig {
                prefill_load_scale: 0.5,
                ..dynamo()
            },
            cand(7, 6, 0, 0, idle),
            2.0,
        ),
        (
            SelectorConfig {
                host_weight: 1.0,
                disk_weight: 1.0,
                ..dynamo()
            },
            cand(8, 2, 4, 4, idle),
            0.0,
        ),
        // kvbm's balance term, outside the clamp: 10 * 0.5 * 64 / 16 = 20 blocks on top of a
        // prefill term of 0 (credit past the prompt) ...
        (
            SelectorConfig {
                prefill_load_scale: 10.0,
                balance_weight: 0.5,
                ..dynamo()
            },
            Candidate {
                excess_work: 64.0,
                ..cand(9, 30, 0, 0, idle)
            },
            20.0,
        ),
        // ... and nothing when the weight is 0, whatever the excess.
        (
            dynamo(),
            Candidate {
                excess_work: 1e9,
                ..cand(10, 6, 0, 0, idle)
            },
            4.0,
        ),
    ];
    for (config, candidate, expected) in cases {
        assert_eq!(
            config.cost(&candidate, 160, 16),
            expected,
            "{candidate:?} with {config:?}"
        );
    }
}

#[test]
fn the_lowest_cost_wins_and_ties_go_either_way() {
    let idle = WorkerLoad::default();
    let config = dynamo();
    let candidates = [
        cand(1, 2, 0, 0, idle),
        cand(2, 6, 0, 0, idle),
        cand(3, 2, 4, 4, idle),
    ];
    let mut chosen = std::collections::HashSet::new();
    for seed in 0..200 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let s = select(&config, &candidates, 160, 16, &mut rng).unwrap();
        assert_eq!(s.costs, vec![((2, 0), 4.0), ((3, 0), 4.0), ((1, 0), 8.0)]);
        chosen.insert(s.chosen);
    }
    assert_eq!(
        chosen,
        [(2, 0), (3, 0)].into_iter().collect(),
        "both tied workers get chosen, never the dearer one"
    );
    assert!(select(
        &config,
        &[],
        160,
        16,
        &mut rand::rngs::StdRng::seed_from_u64(0)
    )
    .is_none());
}

#[test]
fn a_temperature_samples_by_softened_cost() {
    let idle = WorkerLoad::default();
    // Costs 0 and 10: weights 1 and exp(-1).
    let candidates = [cand(1, 10, 0, 0, idle), cand(2, 0, 0, 0, idle)];
    let config = SelectorConfig {
        temperature: 1.0,
        ..Default::default()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let draws = 20_000;
    let first = (0..draws)
        .filter(|_| {
            select(&config, &candidates, 160, 16, &mut rng)
                .unwrap()
                .chosen
                == (1, 0)
        })
        .count();
    let expected = 1.0 / (1.0 + (-1.0f64).exp());
    let seen = first as f64 / draws as f64;
    assert!(
        (seen - expected).abs() < 0.02,
        "chose the cheaper worker {seen:.3} of the time, expected {expected:.3}"
    );
    // Temperature 0: always the cheaper one.
    let cold = dynamo();
    assert!(
        (0..100).all(|_| select(&cold, &candidates, 160, 16, &mut rng)
            .unwrap()
            .chosen
            == (1, 0))
    );
}

#[test]
fn load_moves_from_prefill_to_decode_and_goes_away() {
    let t0 = Instant::now();
    let w = (9, 1);
    let mut tracker = LoadTracker::new(Duration::from_secs(60));
    tracker.routed("a".into(), w, 100, 16, t0);
    tracker.routed("b".into(), w, 40, 16, t0);
    assert_eq!(tracker.load(w), load(140, 0, 2));
    assert!(tracker.first_token("a", t0));
    // 100 tokens in 16-token blocks: 7 blocks.
    assert_eq!(tracker.load(w), load(40, 7, 2));
    assert!(
        tracker.first_token("a", t0),
        "a second first-token report changes nothing"
    );
    assert_eq!(tracker.load(w), load(40, 7, 2));
    assert!(tracker.finished("a"));
    assert_eq!(tracker.load(w), load(40, 0, 1));
    assert!(
        !tracker.finished("a") && !tracker.first_token("zzz", t0),
        "unknown ids are refused"
    );
    // Routing an id again replaces it.
    tracker.routed("b".into(), (10, 0), 16, 16, t0);
    assert_eq!(
        (tracker.load(w), tracker.load((10, 0))),
        (WorkerLoad::default(), load(16, 0, 1))
    );
    // Never reported: expires after the time-to-live.
    assert_eq!(tracker.expire(t0 + Duration::from_secs(59)), 0);
    assert_eq!(tracker.expire(t0 + Duration::from_secs(60)), 1);
    assert!(tracker.is_empty());
    assert_eq!(tracker.load((10, 0)), WorkerLoad::default());
    // A worker that leaves takes its requests with it.
    tracker.routed("c".into(), w, 16, 16, t0);
    tracker.drop_worker(w);
    assert_eq!((tracker.len(), tracker.load(w)), (0, WorkerLoad::default()));
}

/// Dynamo's cost and default weights, which these tests compute by hand (kvbm's `kv` default
/// weighs the prefill term 10 and host hits 1.0).
fn dynamo() -> SelectorConfig {
    SelectorConfig {
        mode: RouterMode::Dynamo,
        prefill_load_scale: DYNAMO_WEIGHTS.prefill_load_scale,
        overlap_score_credit: DYNAMO_WEIGHTS.overlap_score_credit,
        host_weight: DYNAMO_WEIGHTS.host_weight,
        disk_weight: DYNAMO_WEIGHTS.disk_weight,
        ..SelectorConfig::default()
    }
}
