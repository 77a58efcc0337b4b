"""accounts: API keys, credits, usage records, owner columns, batch price snapshots and queue reservations

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('admin', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('balance', sa.BigInteger(), nullable=True),
    sa.Column('max_pending_batches', sa.Integer(), nullable=True),
    sa.Column('max_enqueued_tokens', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('revoked_at', sa.BigInteger(), nullable=True),
    sa.CheckConstraint(
        '(max_pending_batches IS NULL OR max_pending_batches >= 0) AND '
        '(max_enqueued_tokens IS NULL OR max_enqueued_tokens >= 0)',
        name=op.f('ck_api_keys_quotas'),
    ),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('digest', name=op.f('uq_api_keys_digest'))
    )
    op.create_table('key_credits',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('key_id', sa.String(length=64), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.CheckConstraint('amount > 0', name=op.f('ck_key_credits_amount_positive')),
    sa.ForeignKeyConstraint(['key_id'], ['api_keys.id'], name=op.f('fk_key_credits_key_id_api_keys')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_key_credits'))
    )
    op.create_index('ix_key_credits_key_id', 'key_credits', ['key_id'], unique=False)
    op.create_table('usage_records',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('key_id', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cost', sa.BigInteger(), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=True),
    sa.Column('batch_id', sa.String(length=64), nullable=True),
    sa.Column('line', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.CheckConstraint("kind IN ('realtime', 'batch')", name=op.f('ck_usage_records_kind')),
    sa.CheckConstraint(
        'input_tokens >= 0 AND output_tokens >= 0 AND cost >= 0', name=op.f('ck_usage_records_amounts')
    ),
    sa.CheckConstraint(
        "(kind = 'batch' AND batch_id IS NOT NULL AND line IS NOT NULL) OR "
        "(kind = 'realtime' AND batch_id IS NULL AND line IS NULL)",
        name=op.f('ck_usage_records_source'),
    ),
    sa.ForeignKeyConstraint(['key_id'], ['api_keys.id'], name=op.f('fk_usage_records_key_id_api_keys')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_records')),
    sa.UniqueConstraint('batch_id', 'line', name='uq_usage_records_batch_line'),
    sa.UniqueConstraint('request_id', name=op.f('uq_usage_records_request_id'))
    )
    op.create_index('ix_usage_records_key_day', 'usage_records', ['key_id', 'day'], unique=False)
    op.create_index('ix_usage_records_day', 'usage_records', ['day'], unique=False)
    op.add_column('files', sa.Column('owner_key_id', sa.String(length=64), nullable=True))
    op.create_index('ix_files_owner_key_id', 'files', ['owner_key_id', 'id'], unique=False)
    op.add_column('batches', sa.Column('owner_key_id', sa.String(length=64), nullable=True))
    op.add_column('batches', sa.Column('prices_json', sa.Text(), nullable=True))
    op.add_column('batches', sa.Column('enqueued_tokens', sa.BigInteger(), server_default='0', nullable=False))
    op.add_column('batches', sa.Column('balance_waiting_since', sa.BigInteger(), nullable=True))
    op.create_index('ix_batches_owner_key_id', 'batches', ['owner_key_id', 'id'], unique=False)
    op.add_column('probes', sa.Column('owner_key_id', sa.String(length=64), nullable=True))
    op.add_column('responses', sa.Column('owner_key_id', sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column('responses', 'owner_key_id')
    op.drop_column('probes', 'owner_key_id')
    op.drop_index('ix_batches_owner_key_id', table_name='batches')
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('balance_waiting_since')
        batch_op.drop_column('enqueued_tokens')
        batch_op.drop_column('prices_json')
        batch_op.drop_column('owner_key_id')
    op.drop_index('ix_files_owner_key_id', table_name='files')
    op.drop_column('files', 'owner_key_id')
    op.drop_index('ix_usage_records_day', table_name='usage_records')
    op.drop_index('ix_usage_records_key_day', table_name='usage_records')
    op.drop_table('usage_records')
    op.drop_index('ix_key_credits_key_id', table_name='key_credits')
    op.drop_table('key_credits')
    op.drop_table('api_keys')
