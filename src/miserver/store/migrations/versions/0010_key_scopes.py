"""key scopes: the scopes an API key may use (NULL: the member default, which every existing key keeps)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('scopes', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('scopes')
