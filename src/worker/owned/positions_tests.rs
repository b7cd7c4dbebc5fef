use super::*;

fn who(key: &str) -> Who {
    Who("accounts.apply".into(), key.into())
}

/// A turn of a leased run hands on to the row after it: that number is kept for the
/// row (another message with it is refused, a copy waits, the row itself runs), and
/// the memory is at it. A reservation the row never took (its body did not parse,
/// the circuit kept it out) sends the memory back to the run's first number, to be
/// read again: kept, the entity would wait for that row for ever. One it took stays.
#[test]
fn a_handed_on_turn_is_kept_for_its_row_and_given_back_if_never_taken() {
    let positions = Arc::new(Positions::new(4));
    let entity: Entity = ("s".into(), "account-a".into());
    for taken in [false, true] {
        positions.loaded(&entity, 5);
        assert!(matches!(
            positions.look(&entity, 5, &who("a-5"), false, false),
            Look::Run
        ));
        let reserved = Turn::new(&positions, &entity, 5, who("a-5")).hand_on(who("a-6"));
        assert!(matches!(
            positions.look(&entity, 6, &who("b-6"), false, false),
            Look::Taken
        ));
        assert!(matches!(
            positions.look(&entity, 6, &who("a-6"), false, false),
            Look::Wait(_)
        ));
        assert!(matches!(
            positions.look(&entity, 6, &who("a-6"), true, true),
            Look::Run
        ));
        assert!(matches!(
            positions.look(&entity, 5, &who("a-5"), false, false),
            Look::Behind
        ));
        if taken {
            reserved.taken();
            assert!(matches!(
                positions.look(&entity, 5, &who("a-5"), false, false),
                Look::Behind
            ));
        } else {
            drop(reserved);
            // Back at the run's first number, not confirmed: forgotten, read before
            // anything is decided from it.
            assert!(matches!(
                positions.look(&entity, 6, &who("a-6"), true, true),
                Look::Load
            ));
        }
    }
}

/// A turn released from its row that no turn before it kept memory for (one a takeover
/// runs) waits while the broker's copy of the same message holds the turn: one turn
/// of a place at a time.
#[test]
fn a_row_not_kept_for_waits_for_its_copy_that_holds_the_turn() {
    let positions = Arc::new(Positions::new(4));
    let entity: Entity = ("s".into(), "account-a".into());
    positions.loaded(&entity, 5);
    assert!(matches!(
        positions.look(&entity, 5, &who("a-5"), false, false),
        Look::Run
    ));
    assert!(matches!(
        positions.look(&entity, 5, &who("a-5"), true, false),
        Look::Wait(_)
    ));
}

/// A turn of a leased run whose long-turn mark moved the position to its own
/// number moves from there, and so does the turn it hands on to (else their moves
/// and holds would be fenced on the run's first number, which the database left).
#[test]
fn a_marked_turn_of_a_run_moves_from_its_own_number() {
    let positions = Arc::new(Positions::new(4));
    let entity: Entity = ("s".into(), "account-a".into());
    positions.loaded(&entity, 3);
    let mut turn = Turn::new(&positions, &entity, 5, who("a-5"));
    turn.ran_from(3);
    assert_eq!(turn.done().from, 3);
    turn.stands_at_own();
    assert_eq!(turn.done().from, 5);
    let reserved = turn.hand_on(who("a-6"));
    assert_eq!(reserved.from(), 5);
    reserved.taken();
}

/// An entity quiet in memory for longer than [`FORGET_AFTER`] is forgotten and read
/// again before a delivery is decided from it: gc may have taken its position
/// meanwhile, and the entity starts again at its first number. Kept, a number behind
/// the memory would be dead-lettered `sequence_passed` and an early one parked against
/// a position that no longer exists. An entity checked within that time is decided
/// from memory, without a read; one whose move was fenced out is read again at once.
#[test]
fn an_entity_quiet_for_long_is_read_again() {
    let positions = Arc::new(Positions::new(4));
    let entity: Entity = ("s".into(), "account-a".into());
    positions.loaded(&entity, 50);
    assert!(matches!(
        positions.look(&entity, 1, &who("a-1"), false, false),
        Look::Behind
    ));
    assert!(matches!(
        positions.look(&entity, 60, &who("a-60"), false, false),
        Look::Park
    ));
    positions.backdate(&entity, FORGET_AFTER + std::time::Duration::from_secs(1));
    assert!(matches!(
        positions.look(&entity, 1, &who("a-1"), false, false),
        Look::Load
    ));
    // Read again: gc took the position, which starts at 1.
    positions.loaded(&entity, 1);
    assert!(matches!(
        positions.look(&entity, 1, &who("a-1"), false, false),
        Look::Run
    ));
    positions.backdate(&entity, FORGET_AFTER + std::time::Duration::from_secs(1));
    // A turn running is not forgotten: a copy of it waits for it.
    assert!(matches!(
        positions.look(&entity, 1, &who("a-1"), false, false),
        Look::Wait(_)
    ));
    // Its move fenced out (an operator's skip moved the position): not confirmed, so
    // forgotten and read again at the next delivery, however recent the last read.
    positions.end(&entity, 1, &who("a-1"), Some(false), 2);
    assert!(matches!(
        positions.look(&entity, 0, &who("a-0"), false, false),
        Look::Load
    ));
}
