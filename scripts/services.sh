# Sourced by scripts/demo and scripts/test: brings up what idem needs, Postgres on
# 127.0.0.1:5432 (user postgres, password postgres) and RabbitMQ on 127.0.0.1:5672
# (guest/guest), in this order of preference:
#   1. ones already answering on those ports (nothing is started);
#   2. Docker Compose, where a Docker engine runs (docker-compose.yml);
#   3. Debian's packages, where this is Debian or Ubuntu and we may install them (root);
#   4. otherwise one line saying what is missing, and exit 1.

say() { printf '== %s (%ds)\n' "$*" "$SECONDS"; } # with the seconds since the start

port_open() { # port_open PORT: something accepts TCP connections on 127.0.0.1:PORT
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
  local secs=$1 what=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then echo "$what not ready after ${secs}s" >&2; return 1; fi
    sleep 1
  done
}

can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

apt_install() {
  if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

postgres_up() {
  if command -v pg_isready >/dev/null 2>&1; then pg_isready -q -h 127.0.0.1 -p 5432; else port_open 5432; fi
}
rabbitmq_up() { port_open 5672; }

debian_postgres() {
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then say "installing PostgreSQL (Debian's package)"; apt_install postgresql; fi
  say "starting PostgreSQL"
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_for 60 PostgreSQL pg_isready -q -h 127.0.0.1 -p 5432
  # A fresh install authenticates TCP clients by password: give postgres the default one.
  su postgres -c "psql -q -c \"ALTER USER postgres PASSWORD 'postgres'\"" || true
}

debian_rabbitmq() {
  if ! command -v rabbitmq-server >/dev/null 2>&1; then say "installing RabbitMQ (Debian's package)"; apt_install rabbitmq-server; fi
  say "starting RabbitMQ"
  rabbitmq-server -detached || true
  wait_for 120 RabbitMQ rabbitmqctl -q await_startup
}

ensure_services() {
  if postgres_up && rabbitmq_up; then
    say "Postgres on 127.0.0.1:5432 and RabbitMQ on 127.0.0.1:5672 answer: using them"
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    say "starting Postgres and RabbitMQ with Docker Compose (docker-compose.yml)"
    docker compose up -d --wait
  elif can_apt; then
    postgres_up || debian_postgres
    rabbitmq_up || debian_rabbitmq
  else
    local missing
    if ! postgres_up && ! rabbitmq_up; then
      missing="Postgres on 127.0.0.1:5432 and RabbitMQ on 127.0.0.1:5672 do not answer"
    elif ! postgres_up; then missing="Postgres on 127.0.0.1:5432 does not answer"
    else missing="RabbitMQ on 127.0.0.1:5672 does not answer"; fi
    echo "idem: $missing, no Docker engine runs here, and Debian's packages need root: start Docker, install postgresql and rabbitmq-server, or export DATABASE_URL and AMQP_URL for servers elsewhere" >&2
    exit 1
  fi
}
