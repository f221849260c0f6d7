//! The routing modes: each picks what its definition says, from the same candidates.

mod common;

use kvbm_events::router::{
    select_mode, Candidate, LoadTracker, Overlap, RoundRobin, RouterMode, SelectorConfig, Weights,
    WorkerLoad, DYNAMO_WEIGHTS, KV_WEIGHTS, ROUTER_MODE_DEFAULT,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

use common::{cand, load};

fn choose(config: &SelectorConfig, candidates: &[Candidate], rng: &mut StdRng) -> u64 {
    select_mode(
        config,
        candidates,
        160,
        16,
        rng,
        &mut RoundRobin::default(),
        None,
    )
    .unwrap()
    .chosen
    .0
}

#[test]
fn modes_parse_by_name_and_default_to_kv() {
    for mode in RouterMode::ALL {
        assert_eq!(mode.name().parse::<RouterMode>().unwrap(), mode);
    }
    let e = "fastest".parse::<RouterMode>().unwrap_err();
    assert!(e.contains("round-robin") && e.contains("tuned"), "{e}");
    assert_eq!(ROUTER_MODE_DEFAULT, RouterMode::Kv);
    assert_eq!(SelectorConfig::default().mode, RouterMode::Kv);
    assert_eq!(SelectorConfig::default().weights(), KV_WEIGHTS);
}

#[test]
fn round_robin_cycles_in_key_order_over_whoever_is_eligible() {
    let idle = WorkerLoad::default();
    let config = SelectorConfig::for_mode(RouterMode::RoundRobin);
    let mut rng = StdRng::seed_from_u64(1);
    let mut rr = RoundRobin::default();
    // Given out of order, with overlap and load that round robin ignores.
    let all = [
        cand(3, 0, 0, 0, idle),
        cand(1, 10, 0, 0, load(5000, 0, 3)),
        cand(2, 0, 0, 0, idle),
    ];
    let mut picks = Vec::new();
    for _ in 0..7 {
        let s = select_mode(&config, &all, 160, 16, &mut rng, &mut rr, None).unwrap();
        assert_eq!(s.costs[0].0, s.chosen, "the chosen worker is listed first");
        picks.push(s.chosen.0);
    }
    assert_eq!(picks, [1, 2, 3, 1, 2, 3, 1]);
    // Worker 2 is no longer eligible: the cycle goes on after 1, skipping it.
    let without_2 = [all[0], all[1]];
    let next = select_mode(&config, &without_2, 160, 16, &mut rng, &mut rr, None).unwrap();
    assert_eq!(next.chosen.0, 3);
    let next = select_mode(&config, &without_2, 160, 16, &mut rng, &mut rr, None).unwrap();
    assert_eq!(next.chosen.0, 1);
}

#[test]
fn random_is_uniform_whatever_the_load() {
    let config = SelectorConfig::for_mode(RouterMode::Random);
    let mut rng = StdRng::seed_from_u64(7);
    let all = [
        cand(1, 0, 0, 0, load(100_000, 500, 40)),
        cand(2, 10, 0, 0, WorkerLoad::default()),
        cand(3, 0, 0, 0, WorkerLoad::default()),
    ];
    let mut counts = [0usize; 3];
    for _ in 0..3000 {
        counts[choose(&config, &all, &mut rng) as usize - 1] += 1;
    }
    for c in counts {
        assert!((850..=1150).contains(&c), "{counts:?}");
    }
}

#[test]
fn least_loaded_ignores_overlap() {
    let config = SelectorConfig::for_mode(RouterMode::LeastLoaded);
    let mut rng = StdRng::seed_from_u64(3);
    // Worker 1 holds the whole prompt but has 2 blocks of prefill queued; worker 2 holds none
    // and is idle.
    let all = [
        cand(1, 10, 0, 0, load(32, 0, 1)),
        cand(2, 0, 0, 0, WorkerLoad::default()),
    ];
    for _ in 0..20 {
        assert_eq!(choose(&config, &all, &mut rng), 2);
    }
    // prefill_blocks + decode_blocks, whatever the overlap: (32 + 160) / 16 + 4.
    assert_eq!(
        config.cost(&cand(1, 10, 5, 5, load(32, 4, 2)), 160, 16),
        16.0
    );
    // Weight flags do not give it credits.
    let still = config.with_weights(DYNAMO_WEIGHTS);
    assert_eq!(still.weights(), config.weights());
}

#[test]
fn kv_gpu_ignores_host_and_disk_where_kv_counts_them() {
    let mut rng = StdRng::seed_from_u64(5);
    // Worker 1 has the prompt in host memory, worker 2 has nothing; both idle.
    let all = [
        cand(1, 0, 10, 0, WorkerLoad::default()),
        cand(2, 0, 0, 0, WorkerLoad::default()),
    ];
    let gpu_only = SelectorConfig::for_mode(RouterMode::KvGpu);
    assert_eq!(gpu_only.host_weight, 0.0);
    assert_eq!(gpu_only.disk_weight, 0.0);
    assert_eq!(
        gpu_only.cost(&all[0], 160, 16),
        gpu_only.cost(&all[1], 160, 16)
    );
    let mut seen = [0usize; 2];
    for _ in 0..200 {
        seen[choose(&gpu_only, &all, &mut rng) as usize - 1] += 1;
    }
    assert!(
        seen[0] > 50 && seen[1] > 50,
        "a tie, broken at random: {seen:?}"
    );
    let kv = SelectorConfig::for_mode(RouterMode::Kv);
    for _ in 0..20 {
        assert_eq!(choose(&kv, &all, &mut rng), 1);
    }
    // Host and disk weights given on the command line stay 0 in kv-gpu; the GPU credit moves.
    let w = Weights {
        prefill_load_scale: 2.0,
        overlap_score_credit: 0.5,
        host_weight: 1.0,
        disk_weight: 1.0,
    };
    let flagged = gpu_only.with_weights(w);
    assert_eq!(
        (
            flagged.prefill_load_scale,
            flagged.overlap_score_credit,
            flagged.host_weight,
            flagged.disk_weight
        ),
        (2.0, 0.5, 0.0, 0.0)
    );
    assert_eq!(kv.with_weights(w).weights(), w);
}

#[test]
fn dynamo_matches_a_hand_computed_cost_with_the_credit_flag() {
    let config = SelectorConfig::for_mode(RouterMode::Dynamo).with_weights(Weights {
        prefill_load_scale: 2.0,
        overlap_score_credit: 0.5,
        ..DYNAMO_WEIGHTS
    });
    // 160 prompt tokens + 32 queued = 12 blocks; credit 0.5 * 6 + 0.75 * 4 + 0.25 * 4 = 7;
    // 2 * (12 - 7) + 3 decode blocks + 0 * 2 requests = 13.
    let c = cand(1, 6, 4, 4, load(32, 3, 2));
    assert_eq!(config.cost(&c, 160, 16), 13.0);
    // With Dynamo's default credit of 1: credit 6 + 3 + 1 = 10; 2 * (12 - 10) + 3 = 7.
    let default_credit = SelectorConfig::for_mode(RouterMode::Dynamo).with_weights(Weights {
        prefill_load_scale: 2.0,
        ..DYNAMO_WEIGHTS
    });
    assert_eq!(default_credit.cost(&c, 160, 16), 7.0);
    // A credit of 0 leaves the GPU overlap worth nothing: 2 * (12 - 4) + 3 = 19.
    let no_credit = SelectorConfig::for_mode(RouterMode::Dynamo).with_weights(Weights {
        prefill_load_scale: 2.0,
        overlap_score_credit: 0.0,
        ..DYNAMO_WEIGHTS
    });
    assert_eq!(no_credit.cost(&c, 160, 16), 19.0);
}

#[test]
fn tuned_falls_back_to_kv_until_it_has_a_cost() {
    let mut rng = StdRng::seed_from_u64(9);
    let tuned = SelectorConfig::for_mode(RouterMode::Tuned);
    assert_eq!(tuned.weights(), KV_WEIGHTS);
    let all = [
        cand(1, 0, 0, 0, WorkerLoad::default()),
        cand(2, 8, 0, 0, WorkerLoad::default()),
    ];
    // No learned cost: kv's choice (the overlap).
    for _ in 0..10 {
        assert_eq!(choose(&tuned, &all, &mut rng), 2);
    }
    // A learned cost that prefers worker 1 is followed.
    let cost = |c: &Candidate| if c.worker.0 == 1 { 0.1 } else { 0.2 };
    let s = select_mode(
        &tuned,
        &all,
        160,
        16,
        &mut rng,
        &mut RoundRobin::default(),
        Some(&cost),
    )
    .unwrap();
    assert_eq!(s.chosen.0, 1);
    assert_eq!(s.costs, vec![((1, 0), 0.1), ((2, 0), 0.2)]);
}

#[test]
fn a_routed_request_counts_only_its_uncached_prompt_as_prefill() {
    let mut tracker = LoadTracker::new(std::time::Duration::from_secs(60));
    let t0 = std::time::Instant::now();
    // 160 tokens of which 100 are cached: 60 to compute; 10 blocks once decoding.
    tracker.routed_uncached("a".into(), (1, 0), 160, 60, 16, t0);
    assert_eq!(tracker.load((1, 0)), load(60, 0, 1));
    tracker.first_token("a", t0);
    assert_eq!(tracker.load((1, 0)), load(0, 10, 1));
    // More uncached tokens than the prompt cannot be.
    tracker.routed_uncached("b".into(), (1, 0), 16, 1000, 16, t0);
    assert_eq!(tracker.load((1, 0)), load(16, 10, 2));
    // Dynamo's effective_prefill_tokens: the prompt less its weighted credit.
    let kv = SelectorConfig::default();
    assert_eq!(
        kv.uncached_tokens(
            Overlap {
                gpu: 2,
                host: 4,
                disk: 0,
                shared: 0
            },
            160,
            16
        ),
        // 2 GPU blocks and 4 host blocks of 16 tokens at kv's weights.
        160 - (16.0 * (2.0 * KV_WEIGHTS.overlap_score_credit + 4.0 * KV_WEIGHTS.host_weight))
            as usize
    );
    assert_eq!(
        kv.uncached_tokens(
            Overlap {
                gpu: 20,
                host: 0,
                disk: 0,
                shared: 0
            },
            160,
            16
        ),
        0
    );
}
