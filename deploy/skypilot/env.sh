# Sourced by the SkyPilot tasks: the NATS login of one role. Usage: source deploy/skypilot/env.sh ROLE
# Passwords are derived from the secret RLBUS_NATS_PASSWORD_SEED (same on every node of the group), so the
# server (trainer node) and every service agree without a shared file.
role="$1"
group="${SKYPILOT_JOBGROUP_NAME:-rlbus}"
export RLBUS__NATS__URL="nats://${RLBUS_NATS_HOST:-trainer-0.$group}:4222"
for r in trainer rollout judge sandbox weightsync echo tracker teacher admin launcher; do
  pw="$(printf '%s:%s' "$RLBUS_NATS_PASSWORD_SEED" "$r" | sha256sum | cut -c1-48)"
  export "RLBUS_${r^^}_PASSWORD=$pw"
done
export RLBUS__NATS__USER="$role"
pwvar="RLBUS_${role^^}_PASSWORD"
export RLBUS__NATS__PASSWORD="${!pwvar}"
export RLBUS__NATS__INBOX_PREFIX="_INBOX_$role"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
